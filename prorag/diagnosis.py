"""Does RL sharpen, memorise or drift? Pure functions over per-question evaluations (issue 47, before any tuning).

An RL adapter is read against the SFT agent it started from on two question sets: the pool questions RL trained
on, and unseen deep questions. On each, greedy F1 (what the evaluation reports) and sampled F1 at temperature 1
(what RL optimises), the sampled tokens' entropy, and wins and losses by the SFT agent's solve rate:

- **learns**: greedy F1 rises on the unseen questions (an interval above 0);
- **memorises**: greedy F1 rises on the pool questions (an interval above 0) and not on the unseen ones;
- **sharpens**: sampled F1 rises towards greedy F1 and the entropy falls, greedy F1 moving on neither set: RL
  makes the agent's samples agree with what greedy decoding already picked;
- **drifts**: greedy F1 falls on the unseen questions (an interval below 0);
- otherwise **no change** within the noise.

The entropy is the Monte Carlo estimate E[-log p(token)] over tokens sampled at temperature 1, which is the
per-token entropy of the policy's distribution in expectation; it needs only the sampled tokens' log-probs that
the policy service returns.
"""

from __future__ import annotations

from typing import Mapping, Sequence

#: the SFT agent's solve rate (share of its samples that were right) split into bins: a bin's wins and losses
#: say where RL gains (questions it sometimes solved) and where it loses (questions it always solved)
SOLVE_RATE_BINS = ("never", "rarely", "often", "always")


def solve_rate_bin(rate: float) -> str:
    """"never" (0), "rarely" (at most half), "often" (more than half, not all), "always" (1).

    >>> [solve_rate_bin(r) for r in (0.0, 0.25, 0.5, 0.75, 1.0)]
    ['never', 'rarely', 'rarely', 'often', 'always']
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a solve rate is in [0, 1]; got {rate}")
    if rate == 0.0:
        return "never"
    if rate == 1.0:
        return "always"
    return "rarely" if rate <= 0.5 else "often"


def token_entropy(logprobs: Sequence[Sequence[float]]) -> float:
    """Mean -log p over every sampled token of every trajectory: logprobs [N][T_i] of tokens sampled at temperature
    1 -> nats per token (0 when there is no token).

    >>> round(token_entropy([[-0.5, -1.5], [-1.0]]), 3)
    1.0
    """
    flat = [-x for xs in logprobs for x in xs]
    return sum(flat) / len(flat) if flat else 0.0


def wins_losses_by_bin(model: Mapping[str, float], reference: Mapping[str, float], bins: Mapping[str, str],
                       eps: float = 1e-9) -> dict[str, dict]:
    """Per solve-rate bin, the questions where ``model``'s F1 beats, loses to or ties ``reference``'s.

    model, reference: question id -> F1 (greedy); bins: question id -> :data:`SOLVE_RATE_BINS` entry. Questions
    missing from either side are left out. Returns {bin: {"n", "wins", "losses", "ties", "diff"}} (diff: mean F1
    difference) for every bin, empty ones included (n 0, diff 0)."""
    out = {b: {"n": 0, "wins": 0, "losses": 0, "ties": 0, "diff": 0.0} for b in SOLVE_RATE_BINS}
    for q, b in bins.items():
        if q not in model or q not in reference:
            continue
        if b not in out:
            raise ValueError(f"question {q!r}: bin {b!r} is not one of {SOLVE_RATE_BINS}")
        d = model[q] - reference[q]
        row = out[b]
        row["n"] += 1
        row["diff"] += d
        row["wins" if d > eps else "losses" if d < -eps else "ties"] += 1
    for row in out.values():
        row["diff"] = row["diff"] / row["n"] if row["n"] else 0.0
    return out


def reading(pool_greedy_ci: Sequence[float] | None, unseen_greedy_ci: Sequence[float] | None,
            sampled_gain: float, entropy_change: float) -> str:
    """The verdict of the module docstring for one adapter: the 95% intervals of its greedy F1 minus the SFT agent's
    on the pool and unseen questions ([lo, hi], or None when not measured), its sampled F1 gain over the SFT
    agent's on both sets together, and its change in token entropy (nats; negative = sharper).

    >>> reading([0.01, 0.05], [-0.01, 0.02], 0.03, -0.1)
    'memorises'
    >>> reading([-0.01, 0.02], [-0.02, 0.02], 0.04, -0.2)
    'sharpens'
    """
    if unseen_greedy_ci is not None and unseen_greedy_ci[0] > 0:
        return "learns"
    if unseen_greedy_ci is not None and unseen_greedy_ci[1] < 0:
        return "drifts"
    if pool_greedy_ci is not None and pool_greedy_ci[0] > 0:
        return "memorises"
    if sampled_gain > 0 and entropy_change < 0:
        return "sharpens"
    return "no change"


__all__ = ["SOLVE_RATE_BINS", "reading", "solve_rate_bin", "token_entropy", "wins_losses_by_bin"]
