"""Rewards, advantages and policy losses of stages 3-4 and the baselines, as pure functions (verl's core_algos
style): numbers and tensors in, numbers and tensors out; no model, no I/O; shapes in docstrings.

ProRAG's dual-granularity advantage for rollout i of a group of G, at a token t of its step k:

    A_{i,t} = (R_i - mean_G R) / (std_G R + eps)  +  beta * (s_{i,k} - mu) / (sigma + eps)

R is the outcome reward (answer F1 and format), s the step score (PRM score and step validity), and mu,
sigma the mean and standard deviation of s over the group: token-weighted as the reference code computes
them (every generated token of a step counts once, so long steps weigh more), or per step (each step counts
once; ANCHORS.md "Process advantage normalized per step"). beta = 0 is outcome-only GRPO (Search-R1 style).
Only generated tokens carry an advantage: retrieval and glue tokens the environment inserted are masked.

Two optional calibrations of the process term (both off by default, which is the reference's computation):
the PRM logits centred per step kind before they become step scores (:func:`center_per_kind`, as
:func:`reference_step_scores` does), because a Bradley-Terry PRM leaves each kind of step at its own offset and
normalising all kinds together pushes a low-offset kind down in every group; and a floor under sigma
(``std_floor``), so a group whose steps all score alike does not blow tiny differences up to unit scale.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import torch

from prorag.tokens import StepSpan

EPS = 1e-4  # the reference code's std epsilon for the outcome normalisation
#: the F1 from which an answer earns outcome credit in the reference code's reward
ANSWER_CREDIT_F1 = 0.2


# ---------------------------------------------------------------- rewards
def outcome_reward_reference(f1: float, format_valid: bool, threshold: float = ANSWER_CREDIT_F1) -> float:
    """The reference code's outcome reward: (2 F1 if F1 >= threshold else 0) + (+1 valid format / -1 invalid).

    >>> outcome_reward_reference(0.5, True), outcome_reward_reference(0.1, True), outcome_reward_reference(1.0, False)
    (2.0, 1.0, 1.0)
    """
    return (2.0 * f1 if f1 >= threshold else 0.0) + (1.0 if format_valid else -1.0)


def outcome_reward_paper(f1: float, format_valid: bool, nu: float = 1.0) -> float:
    """The paper's outcome reward: F1 + nu * I(valid format).

    >>> outcome_reward_paper(0.5, True), outcome_reward_paper(0.5, False)
    (1.5, 0.5)
    """
    return f1 + (nu if format_valid else 0.0)


def outcome_reward_f1(f1: float, format_valid: bool) -> float:
    """The answer's F1 alone, with no format term (Search-R1 rewards exact match alone): a term a policy earns
    without answering right (the format's +/-1) can outweigh the answer's, and on dev the reference reward taught
    the greedy agent valid format at the cost of right answers (docs/BENCHMARKS.md).

    >>> outcome_reward_f1(0.5, True), outcome_reward_f1(0.5, False), outcome_reward_f1(0.0, True)
    (0.5, 0.5, 0.0)
    """
    return f1


def step_score_reference(prm_logit: float, step_valid: bool) -> float:
    """The reference code's step score: sigmoid(PRM logit) + (+1 for a valid step / -2 for an invalid one).

    >>> round(step_score_reference(0.0, True), 3), round(step_score_reference(0.0, False), 3)
    (1.5, -1.5)
    """
    return 1.0 / (1.0 + math.exp(-prm_logit)) + (1.0 if step_valid else -2.0)


def step_score_verdict(prm_logit: float, step_valid: bool) -> float:
    """The step's verdict alone, sigmoid(PRM logit), with no format term: with an outcome reward that has none
    either (``f1``), the process arms then differ from outcome GRPO in the step verdicts only, not in format
    shaping as well. An invalid step is left to the PRM (or the oracle), which judges it unsound.

    >>> round(step_score_verdict(0.0, True), 3), round(step_score_verdict(0.0, False), 3)
    (0.5, 0.5)
    """
    return 1.0 / (1.0 + math.exp(-prm_logit))


#: name -> outcome reward, for configuration (the reference code's is the default of the RL stage)
OUTCOME_REWARDS: dict[str, Callable[..., float]] = {"reference": outcome_reward_reference,
                                                    "paper": outcome_reward_paper, "f1": outcome_reward_f1}
#: name -> step score of (PRM logit, step valid), for configuration (the reference code's is the RL stage's default)
STEP_SCORES: dict[str, Callable[[float, bool], float]] = {"reference": step_score_reference,
                                                          "verdict": step_score_verdict}


def credit_counts(groups: dict[str, list[int]], f1s: Sequence[float], hops: dict[str, int],
                  threshold: float = ANSWER_CREDIT_F1, min_hops: int = 3) -> dict[str, int]:
    """Groups where no rollout's answer earns credit (F1 under ``threshold``): their outcome advantage can only
    tell valid format from invalid, so only a process term says which of their steps were better. Counted over
    all groups and over those of ``min_hops``+ hop questions, where the policy fails most.

    groups: question id -> indices into f1s [N]; hops: question id -> hop count.

    >>> credit_counts({"a": [0, 1], "b": [2, 3]}, [0.0, 0.5, 0.1, 0.0], {"a": 1, "b": 3})
    {'groups_uncredited': 1, 'deep_groups': 1, 'deep_groups_uncredited': 1}
    """
    uncredited = {q for q, members in groups.items() if not any(f1s[i] >= threshold for i in members)}
    deep = {q for q in groups if hops[q] >= min_hops}
    return {"groups_uncredited": len(uncredited), "deep_groups": len(deep),
            "deep_groups_uncredited": len(uncredited & deep)}


# ---------------------------------------------------------------- rejection sampling (RFT)
def rft_keep(correct: bool, format_valid: bool, step_scores: Sequence[float], threshold: float = 0.0) -> bool:
    """Whether a sampled trajectory becomes RFT training data: a correct answer in a valid format, and every
    step scored by the PRM at or above ``threshold`` (ProRAG keeps steps with PRM logit >= 0).

    step_scores [S] (PRM logits; empty when no PRM filters, e.g. the "RFT only" baseline's outcome filter).

    >>> rft_keep(True, True, [0.3, 1.2]), rft_keep(True, True, [0.3, -0.1]), rft_keep(False, True, [2.0])
    (True, False, False)
    """
    return bool(correct and format_valid and all(s >= threshold for s in step_scores))


def rft_threshold(weakest_steps: Sequence[float], keep_fraction: float) -> float:
    """The PRM threshold that lets the best ``keep_fraction`` of correct trajectories through, judged by their
    weakest step: the ceil(keep_fraction * N)-th highest of ``weakest_steps`` [N] (each trajectory's lowest step
    score; ties at the threshold all pass).

    Why: a Bradley-Terry PRM is trained on score differences between siblings, so its logits carry an arbitrary
    offset (per kind of step it never compared), and a fixed threshold such as ProRAG's 0 can keep everything or
    nothing; a fraction means the same thing for any PRM.

    >>> rft_threshold([-2.0, -1.0, 0.5, 3.0], 0.5), rft_threshold([-2.0, -1.0, 0.5, 3.0], 1.0)
    (0.5, -2.0)
    >>> rft_threshold([0.1, 0.2, 0.3], 0.34)  # 0.34 of 3 is 1.02 trajectories: two pass
    0.2
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if not weakest_steps:
        return float("inf")
    xs = sorted(weakest_steps)
    k = min(len(xs) - 1, max(0, len(xs) - int(math.ceil(keep_fraction * len(xs)))))
    return float(xs[k])


def rft_kept_steps(correct: bool, format_valid: bool, step_scores: Sequence[float], threshold: float = 0.0
                   ) -> list[bool]:
    """ProRAG's RFT filter per step: of a correct trajectory in a valid format, the steps whose PRM score is at or
    above ``threshold`` are trained on (the others stay in the context, out of the loss); of any other trajectory,
    none.

    step_scores [S] (PRM logits, possibly centred per kind) -> [S].

    >>> rft_kept_steps(True, True, [0.3, -0.1, 1.0]), rft_kept_steps(False, True, [2.0])
    ([True, False, True], [False])
    """
    ok = bool(correct and format_valid)
    return [ok and s >= threshold for s in step_scores]


def step_loss_mask(kept: Sequence[bool], spans: Sequence[StepSpan], length: int) -> list[int]:
    """A token mask that puts the loss on the generated tokens of the kept steps only.

    kept [S] (one flag per step); spans [S] (token positions of each step in a sequence of ``length`` tokens).
    Returns [T]: 1 on a kept step's generated tokens; 0 on the prompt, inserted documents and glue, and on every
    token of a step that is not kept (it stays in the sequence as context for the steps after it).

    >>> step_loss_mask([False, True], [StepSpan(2, 4, 6), StepSpan(6, 8, 8)], 9)
    [0, 0, 0, 0, 0, 0, 1, 1, 0]
    """
    if len(kept) != len(spans):
        raise ValueError(f"{len(kept)} kept-step flags for {len(spans)} steps")
    mask = [0] * length
    for k, span in zip(kept, spans):
        if not 0 <= span.start <= span.generated_end <= span.end <= length:
            raise ValueError(f"step span {span} does not fit a sequence of {length} tokens")
        if k:
            mask[span.start:span.generated_end] = [1] * (span.generated_end - span.start)
    return mask


def hop_balanced_sample(hops: Sequence[int], n: int, seed: int) -> list[int]:
    """Draw ``n`` questions evenly over hop counts: each of the H hop counts present gets n / H of them (counts
    differ by at most one; the extra ones go to the hop counts with fewest questions first), and the share a hop
    count cannot fill is spread over the others.

    Why: a policy answers shallow questions correctly far more often, so drawing in the split's order fills a
    correctness filter's output with them (RFT then teaches stopping early).

    hops [N] (each question's hop count); n (0 or >= N: every question); seed fixes which questions of a hop
    count are drawn. Returns the drawn indices into ``hops``, ascending (the split's order).

    >>> hops = [1, 1, 1, 1, 2, 2, 3]
    >>> [hops[i] for i in hop_balanced_sample(hops, 5, seed=0)]  # 3 hops has one question: 1 and 2 share its share
    [1, 1, 2, 2, 3]
    """
    if n <= 0 or n >= len(hops):
        return list(range(len(hops)))
    by_hops: dict[int, list[int]] = {}
    for i, h in enumerate(hops):
        by_hops.setdefault(int(h), []).append(i)
    rng = random.Random(seed)
    for h in sorted(by_hops):
        rng.shuffle(by_hops[h])
    # fill the hop counts with fewest questions first, so what one cannot take is shared by those after it
    order = sorted(by_hops, key=lambda h: (len(by_hops[h]), h))
    drawn: list[int] = []
    left = n
    for j, h in enumerate(order):
        take = min(len(by_hops[h]), math.ceil(left / (len(order) - j)))
        drawn += by_hops[h][:take]
        left -= take
    return sorted(drawn)


# ---------------------------------------------------------------- advantages
def group_normalized(rewards: Sequence[float], eps: float = EPS) -> list[float]:
    """GRPO's outcome advantage: (R_i - mean) / (std + eps) within one group.

    rewards [G] -> [G]. The standard deviation is the sample one (ddof 1), as TRL's GRPO (which the reference
    code subclasses) takes it with ``torch.std``; a group of one gets advantage 0.

    >>> [round(a, 3) for a in group_normalized([1.0, 0.0])]
    [0.707, -0.707]
    """
    g = len(rewards)
    if g == 0:
        return []
    if max(rewards) == min(rewards):
        # exactly 0, not the rounding of a mean (3 x 0.4 averages to 0.4000000000000001): a flat group then adds
        # nothing to the update, which skips it (adds_policy_gradient)
        return [0.0] * g
    mean = sum(rewards) / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def group_centered(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO's outcome advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"): R_i - mean within one
    group, not divided by the group's spread. rewards [G] -> [G].

    Why it exists: with a graded reward (the answer's F1) a group whose rollouts nearly agree has a tiny spread, and
    dividing by it blows a 0.1 F1 difference up to the size of a right-against-wrong one, so such questions steer the
    update as much as the ones where the answer is really won or lost.

    >>> [round(a, 3) for a in group_centered([1.0, 1.0, 1.0, 0.9])]
    [0.025, 0.025, 0.025, -0.075]
    >>> [round(a, 2) for a in group_normalized([1.0, 1.0, 1.0, 0.9])]
    [0.5, 0.5, 0.5, -1.5]
    """
    if not rewards or max(rewards) == min(rewards):
        return [0.0] * len(rewards)  # exactly, as in group_normalized
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def step_score_stats(step_scores: Sequence[Sequence[float]], step_weights: Sequence[Sequence[float]]
                     ) -> tuple[float, float]:
    """Weighted mean and standard deviation of the step scores of a group.

    step_scores [G][S_i]; step_weights [G][S_i]: each step's weight (its number of generated tokens for the
    reference's token-weighted statistics, 1 for per-step). Population variance (ddof 0), as a token-level
    mean/std over a flat tensor. Steps with weight 0 do not count. No weight at all -> (0, 0)."""
    total = sum(w for ws in step_weights for w in ws)
    if total <= 0:
        return 0.0, 0.0
    pairs = [(s, w) for ss, ws in zip(step_scores, step_weights) for s, w in zip(ss, ws)]
    mean = sum(s * w for s, w in pairs) / total
    var = sum(w * (s - mean) ** 2 for s, w in pairs) / total
    return mean, math.sqrt(var)


def step_weights(step_tokens: Sequence[Sequence[int]], normalization: str = "token") -> list[list[float]]:
    """Each step's weight in a group's statistics: its number of generated tokens ("token", the reference: every
    generated token of the group counts once) or 1 per step that generated anything ("step").

    step_tokens [G][S_i] -> [G][S_i].

    >>> step_weights([[3, 0], [2]], "token"), step_weights([[3, 0], [2]], "step")
    ([[3.0, 0.0], [2.0]], [[1.0, 0.0], [1.0]])
    """
    if normalization == "token":
        return [[float(n) for n in ns] for ns in step_tokens]
    if normalization == "step":
        return [[1.0 if n > 0 else 0.0 for n in ns] for ns in step_tokens]
    raise ValueError(f"normalization must be 'token' or 'step', got {normalization!r}")


def center_per_kind(values: Sequence[Sequence[float]], kinds: Sequence[Sequence[str]],
                    weights: Sequence[Sequence[float]]) -> list[list[float]]:
    """Each step's value minus the weighted mean of the values of its kind's steps in the group.

    values [G][S_i] (e.g. PRM logits); kinds [G][S_i] (Step.kind: "subquery", "subanswer", "answer", "invalid");
    weights [G][S_i] (:func:`step_weights`, the same weighting as the process normalisation that follows). A step
    of weight 0 does not move its kind's mean but is shifted by it; a kind with no weight at all is left as it is.
    Returns [G][S_i].

    >>> center_per_kind([[1.0, 3.0], [2.0, 5.0]], [["subquery", "answer"], ["subquery", "answer"]],
    ...                 [[1, 1], [1, 1]])
    [[-0.5, -1.0], [0.5, 1.0]]
    """
    if not [len(v) for v in values] == [len(k) for k in kinds] == [len(w) for w in weights]:
        raise ValueError("values, kinds and weights must have one entry per step of each rollout")
    total: dict[str, float] = {}
    weighted_sum: dict[str, float] = {}
    for vs, ks, ws in zip(values, kinds, weights):
        for v, k, w in zip(vs, ks, ws):
            total[k] = total.get(k, 0.0) + w
            weighted_sum[k] = weighted_sum.get(k, 0.0) + w * v
    means = {k: weighted_sum[k] / t for k, t in total.items() if t > 0}
    return [[v - means.get(k, 0.0) for v, k in zip(vs, ks)] for vs, ks in zip(values, kinds)]


#: prm_centering options: the reference's raw PRM logits, or logits centred per step kind within the group
PRM_CENTERINGS = ("none", "per_kind")


def reference_step_scores(prm_logits: Sequence[Sequence[float]], step_kinds: Sequence[Sequence[str]],
                          step_tokens: Sequence[Sequence[int]], centering: str = "none",
                          normalization: str = "token", score: str = "reference") -> list[list[float]]:
    """One group's step scores s = STEP_SCORES[score](logit, kind != "invalid") (the reference's by default), the
    PRM logits first centred per step kind over the group when ``centering`` is "per_kind" (:func:`center_per_kind`,
    each step weighted as ``normalization`` weighs it in the process statistics: token- or step-weighted).

    The logits are centred, not s: a Bradley-Terry PRM's per-kind offset is additive in logit space, and s's
    format term (+1 valid / -2 invalid) must survive, which centring s per kind would cancel.

    prm_logits [G][S_i]; step_kinds [G][S_i]; step_tokens [G][S_i]: generated tokens of each step.
    Returns [G][S_i].

    >>> [[round(x, 3) for x in ss] for ss in reference_step_scores(
    ...     [[2.0, 4.0], [0.0]], [["subquery", "answer"], ["subquery"]], [[1, 1], [1]], "per_kind", "step")]
    [[1.731, 1.5], [1.269]]
    """
    if centering not in PRM_CENTERINGS:
        raise ValueError(f"centering must be one of {PRM_CENTERINGS}, got {centering!r}")
    if score not in STEP_SCORES:
        raise ValueError(f"score must be one of {tuple(STEP_SCORES)}, got {score!r}")
    if centering == "per_kind":
        prm_logits = center_per_kind(prm_logits, step_kinds, step_weights(step_tokens, normalization))
    score_fn = STEP_SCORES[score]
    return [[score_fn(x, k != "invalid") for x, k in zip(xs, ks)] for xs, ks in zip(prm_logits, step_kinds)]


def process_advantages(step_scores: Sequence[Sequence[float]], step_tokens: Sequence[Sequence[int]],
                       normalization: str = "token", eps: float = EPS, std_floor: float = 0.0,
                       scored: Sequence[Sequence[bool]] | None = None) -> list[list[float]]:
    """Each step's normalised score (s - mu) / (max(sigma, std_floor) + eps) within the group.

    step_scores [G][S_i]; step_tokens [G][S_i]: generated tokens of each step. normalization: "token" (the
    reference: statistics over every generated token of the group) or "step" (each step counts once).
    std_floor: the least spread a group's scores are divided by (0 = the reference), so a group whose steps all
    score alike keeps its small differences small. scored [G][S_i] (None = every step): the steps the process term
    reads; the others neither move mu and sigma nor get a process advantage (0), e.g. the final answer, whose
    verdict repeats the outcome. Returns [G][S_i].

    >>> [round(a, 3) for a in process_advantages([[1.0, 1.2]], [[1, 1]], "step", std_floor=1.0)[0]]
    [-0.1, 0.1]

    (sigma is 0.1 here: without the floor the two steps would get -1 and +1.)
    """
    weights = step_weights(step_tokens, normalization)
    if [len(s) for s in step_scores] != [len(t) for t in step_tokens]:
        raise ValueError("step_scores and step_tokens must have one entry per step of each rollout")
    if scored is None:
        scored = [[True] * len(ss) for ss in step_scores]
    elif [len(m) for m in scored] != [len(ss) for ss in step_scores]:
        raise ValueError("scored must have one entry per step of each rollout")
    weights = [[w if m else 0.0 for w, m in zip(ws, ms)] for ws, ms in zip(weights, scored)]
    mu, sigma = step_score_stats(step_scores, weights)
    sigma = max(sigma, std_floor)
    return [[(s - mu) / (sigma + eps) if m else 0.0 for s, m in zip(ss, ms)] for ss, ms in zip(step_scores, scored)]


def dual_granularity_advantages(outcome: Sequence[float], process: Sequence[Sequence[float]],
                                beta: float) -> list[list[float]]:
    """A_{i,k} = outcome_i + beta * process_{i,k}: outcome [G] (group-normalised), process [G][S_i]
    (normalised step scores) -> [G][S_i]. beta = 0 gives every step its rollout's outcome advantage."""
    if len(outcome) != len(process):
        raise ValueError("one outcome advantage per rollout")
    return [[a + beta * p for p in ps] for a, ps in zip(outcome, process)]


def group_step_advantages(rewards: Sequence[float], step_scores: Sequence[Sequence[float]] | None,
                          step_tokens: Sequence[Sequence[int]], beta: float, normalization: str = "token",
                          eps: float = EPS, std_floor: float = 0.0,
                          scored: Sequence[Sequence[bool]] | None = None) -> list[list[float]]:
    """One group's per-step advantages: group_normalized(rewards) + beta * process_advantages(step_scores).

    rewards [G]; step_scores [G][S_i] (step scores s_k, e.g. :func:`reference_step_scores` of the PRM logits),
    or None when there are none; step_tokens [G][S_i]: generated tokens of each step; std_floor and scored: the
    process normalisation's floor under sigma and the steps it reads (:func:`process_advantages`). Returns
    [G][S_i]. With beta = 0 or no step scores the process term is dropped entirely (outcome-only GRPO): every step
    of rollout i gets rollout i's normalised outcome.

    >>> [[round(a, 3) for a in ss] for ss in group_step_advantages([1.0, 0.0], None, [[3, 2], [4]], beta=0.3)]
    [[0.707, 0.707], [-0.707]]
    """
    return _with_process_term(group_normalized(rewards, eps), step_scores, step_tokens, beta, normalization, eps,
                              std_floor, scored)


def centered_step_advantages(rewards: Sequence[float], step_scores: Sequence[Sequence[float]] | None,
                             step_tokens: Sequence[Sequence[int]], beta: float, normalization: str = "token",
                             eps: float = EPS, std_floor: float = 0.0,
                             scored: Sequence[Sequence[bool]] | None = None) -> list[list[float]]:
    """:func:`group_step_advantages` with Dr. GRPO's outcome term, :func:`group_centered` (R_i - mean, no division
    by the group's spread); the process term is the same. Shapes as there.

    >>> [[round(a, 3) for a in ss] for ss in centered_step_advantages([1.0, 0.5], None, [[3, 2], [4]], beta=0.3)]
    [[0.25, 0.25], [-0.25]]
    """
    return _with_process_term(group_centered(rewards), step_scores, step_tokens, beta, normalization, eps, std_floor,
                              scored)


def _with_process_term(outcome: list[float], step_scores: Sequence[Sequence[float]] | None,
                       step_tokens: Sequence[Sequence[int]], beta: float, normalization: str, eps: float,
                       std_floor: float, scored: Sequence[Sequence[bool]] | None) -> list[list[float]]:
    """outcome [G] + beta * process_advantages(step_scores) [G][S_i]; the process term dropped (every step gets its
    rollout's outcome advantage) when beta = 0 or there are no step scores."""
    if beta == 0 or step_scores is None:
        process = [[0.0] * len(ns) for ns in step_tokens]
    else:
        process = process_advantages(step_scores, step_tokens, normalization, eps, std_floor, scored)
    return dual_granularity_advantages(outcome, process, beta)


#: name -> one group's per-step advantage estimator, for configuration (RLConfig.advantage): called as
#: f(rewards [G], step_scores [G][S_i] or None, step_tokens [G][S_i], beta, normalization, std_floor=, scored=)
#: -> [G][S_i]. "grpo" is ProRAG's dual-granularity GRPO (outcome-only GRPO when beta = 0 or no step scores).
#: "dr_grpo" centres the outcome without dividing by the group's spread (Dr. GRPO).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., list[list[float]]]] = {"grpo": group_step_advantages,
                                                                     "dr_grpo": centered_step_advantages}


def token_advantages(step_advantages: Sequence[float], spans: Sequence[StepSpan], length: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast each step's advantage to the tokens the policy generated in it.

    step_advantages [S]; spans [S] (token positions of each step in a sequence of ``length`` tokens).
    Returns (advantages [T] float, loss_mask [T] float): the prompt, retrieved documents and glue tokens the
    environment inserted get advantage 0 and mask 0."""
    if len(step_advantages) != len(spans):
        raise ValueError(f"{len(step_advantages)} advantages for {len(spans)} steps")
    adv = torch.zeros(length)
    mask = torch.zeros(length)
    for a, span in zip(step_advantages, spans):
        if not 0 <= span.start <= span.generated_end <= span.end <= length:
            raise ValueError(f"step span {span} does not fit a sequence of {length} tokens")
        adv[span.start:span.generated_end] = a
        mask[span.start:span.generated_end] = 1.0
    return adv, mask


# ---------------------------------------------------------------- losses
def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip: float = 0.2, kl_coef: float = 0.0,
                        ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate, averaged over the masked tokens of the batch (token-mean, as DAPO and
    the reference's TRL loss), plus an optional k3 KL penalty to a reference policy.

    logprobs [B, T] (with grad), old_logprobs [B, T] (the sampling policy's), advantages [B, T], mask [B, T]
    (1 = a generated token), ref_logprobs [B, T] when kl_coef > 0. Returns (loss scalar, stats: clip_fraction,
    approx_kl, kl, tokens)."""
    mask = mask.to(logprobs.dtype)
    n = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0  # unbiased, non-negative estimator of KL(pi || ref)
        per_token = per_token + kl_coef * k3
        kl_value = (k3 * mask).sum() / n
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip).to(mask.dtype)
        stats = {"clip_fraction": float((was_clipped * mask).sum() / n),
                 "approx_kl": float(((old_logprobs - logprobs) * mask).sum() / n),
                 "kl": float(kl_value), "tokens": float(mask.sum())}
    return loss, stats


def adds_policy_gradient(advantages: Sequence[float], loss_mask: Sequence[float], kl_coef: float = 0.0) -> bool:
    """Whether a trajectory can move the clipped loss at all: advantages [T] and loss_mask [T] are its per-token
    lists. Without a KL term a token's loss -min(r A, clip(r) A) is 0 with a zero gradient wherever A = 0, so a
    trajectory whose every trained token has A = 0 (a group whose rollouts all earned one reward, under an
    outcome-only advantage) changes nothing but the token count it is averaged over; the update skips its forward
    pass and keeps that count.

    >>> adds_policy_gradient([0.0, 0.5], [0.0, 1.0]), adds_policy_gradient([0.5, 0.0], [0.0, 1.0])
    (True, False)
    >>> adds_policy_gradient([0.0, 0.0], [1.0, 1.0], kl_coef=0.05)  # the KL term has a gradient of its own
    True
    """
    return kl_coef > 0 or any(a != 0.0 and m for a, m in zip(advantages, loss_mask))


#: name -> token-level policy loss, for configuration (RLConfig.policy_loss): called as
#: f(logprobs [B, T], old_logprobs [B, T], advantages [B, T], mask [B, T], clip=, kl_coef=, ref_logprobs=)
#: -> (loss scalar, stats with clip_fraction, approx_kl, kl, tokens)
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {"clipped": clipped_policy_loss}


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.3) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO's sigmoid loss (ReasonRAG: beta 0.3): -log sigmoid(beta * ((pc - rc) - (pr - rr))), batch mean.

    Each argument [B]: summed log-probabilities of the chosen / rejected continuation under the policy and the
    reference. Returns (loss, stats: reward_accuracy, margin)."""
    logits = beta * ((chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps))
    loss = -torch.nn.functional.logsigmoid(logits).mean()
    with torch.no_grad():
        stats = {"reward_accuracy": float((logits > 0).float().mean()), "margin": float(logits.mean() / beta)}
    return loss, stats


__all__ = ["ADVANTAGE_ESTIMATORS", "ANSWER_CREDIT_F1", "EPS", "OUTCOME_REWARDS", "POLICY_LOSSES", "PRM_CENTERINGS",
           "adds_policy_gradient", "center_per_kind", "centered_step_advantages", "clipped_policy_loss",
           "credit_counts", "dpo_loss", "dual_granularity_advantages",
           "group_centered", "group_normalized", "group_step_advantages", "hop_balanced_sample", "outcome_reward_f1",
           "outcome_reward_paper", "outcome_reward_reference", "process_advantages", "reference_step_scores",
           "rft_keep", "rft_kept_steps", "rft_threshold", "step_loss_mask", "STEP_SCORES", "step_score_reference",
           "step_score_verdict", "step_score_stats", "step_weights", "token_advantages"]
