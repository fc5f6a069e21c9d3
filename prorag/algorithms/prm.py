"""Process reward model: where a step's score is read, how a long trajectory is cut, and the pairwise loss.

One rendering serves training and scoring: a trajectory's tokens as the policy saw them, each step scored at
its last token (after the documents the environment inserted, so a subquery is judged with what it
retrieved). Reading every step's score at a fixed position of one sequence lets one forward pass score all
steps; the reference code instead appends EOS when training and not when scoring, and truncates on the right,
dropping the newest step (ANCHORS.md). Pure functions; tensors and lists in, no model.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from prorag.tokens import StepSpan


def score_positions(spans: Sequence[StepSpan]) -> list[int]:
    """[S] index of each step's score token: its last token, inserted documents included (end - 1).
    A step with no token at all is an error (nothing to score)."""
    out = []
    for k, s in enumerate(spans):
        if s.end <= s.start:
            raise ValueError(f"step {k} has no tokens (start {s.start}, end {s.end})")
        out.append(s.end - 1)
    return out


def left_truncate(token_ids: Sequence[int], positions: Sequence[int], max_len: int,
                  keep_prefix: int = 0) -> tuple[list[int], list[int | None]]:
    """Fit a sequence into max_len tokens by cutting from the left, after a kept prefix (the system prompt
    and question, which every step is judged against).

    token_ids [T]; positions [S] score positions in it; keep_prefix: tokens at the start that are never cut
    (reduced if it would leave no room). Returns (ids [<= max_len], positions [S]: each shifted into the new
    sequence, or None where the step's score token was cut away). The last position is always kept:
    the newest step is never dropped."""
    if max_len < 1:
        raise ValueError("max_len must be >= 1")
    t = len(token_ids)
    if t <= max_len:
        return list(token_ids), list(positions)
    keep_prefix = max(0, min(keep_prefix, max_len - 1))
    cut = t - max_len  # tokens removed right after the prefix
    ids = list(token_ids[:keep_prefix]) + list(token_ids[keep_prefix + cut:])
    shifted: list[int | None] = []
    for p in positions:
        if p < keep_prefix:
            shifted.append(p)
        elif p < keep_prefix + cut:
            shifted.append(None)
        else:
            shifted.append(p - cut)
    return ids, shifted


def written_positions(spans: Sequence[StepSpan], generated_mask: Sequence[int]) -> list[list[int]]:
    """[S] per step, the indices inside its span of the tokens the policy wrote (generated_mask [T] true: its
    subquery, sub-answer or answer and their tags), in order; the documents the environment inserted and the glue
    are not written. What a likelihood readout averages over."""
    return [[p for p in range(s.start, s.end) if generated_mask[p]] for s in spans]


def left_truncate_steps(token_ids: Sequence[int], positions: Sequence[int], written: Sequence[Sequence[int]],
                        max_len: int, keep_prefix: int = 0) -> tuple[list[int], list[int | None], list[list[int]]]:
    """:func:`left_truncate` that also carries each step's written-token indices (written [S] lists into token_ids):
    returns (ids, positions [S] as left_truncate's, written [S], each shifted into the new sequence, the indices the
    cut removed left out)."""
    flat = [p for w in written for p in w]
    ids, shifted = left_truncate(token_ids, [*positions, *flat], max_len, keep_prefix)
    out, at = [], len(positions)
    for w in written:
        out.append([p for p in shifted[at:at + len(w)] if p is not None])
        at += len(w)
    return ids, shifted[:len(positions)], out


def predecessors(indices: Sequence[int], branch: tuple[int, int, int]) -> list[int]:
    """For token indices of a row laid out as :func:`branch_attention`'s (prefix, first, second) counts, the index
    whose output predicts each token: the one before it, except the second branch's first token, which continues
    the prefix and is predicted by the prefix's last. An index 0 has no predecessor (ValueError)."""
    prefix, first, second = branch
    out = []
    for j in indices:
        if j <= 0:
            raise ValueError("token 0 has no predecessor: nothing predicts it")
        out.append(prefix - 1 if second and j == prefix + first else j - 1)
    return out


def mean_per_step(values: torch.Tensor, step_of: torch.Tensor, steps: int) -> torch.Tensor:
    """Mean of ``values`` [K] per step: step_of [K] long, each value's step in [0, steps). Returns [steps], 0 for a
    step with no value (a step the policy wrote nothing in gets no likelihood term)."""
    total = torch.zeros(steps, dtype=values.dtype, device=values.device).index_add(0, step_of, values)
    count = torch.zeros(steps, dtype=values.dtype, device=values.device).index_add(
        0, step_of, torch.ones_like(values))
    return total / count.clamp(min=1)


def shared_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens at the start of ``a`` and ``b`` that are equal (their longest common prefix). Compared on ids, not
    text: a step can tokenise differently across the boundary with what precedes it."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def branch_attention(rows: Sequence[tuple[int, int, int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and positions for rows that each hold a prefix and two branches continuing it independently.

    rows [B] of (prefix, first, second) token counts: a row's tokens are the prefix, then the first branch, then
    the second, then padding up to ``length`` T (first = second = 0: a plain sequence). Returns (allowed
    [B, T, T] bool, True where query i may attend key j; position_ids [B, T] long). Every token attends causally
    to the prefix and its own branch only, and the second branch's positions restart where the prefix ends, so
    each branch computes what it would as the continuation of the prefix in a sequence of its own. A padding
    token attends only to itself (a query with no key would make softmax undefined) at position 0."""
    if any(min(r) < 0 for r in rows):
        raise ValueError("token counts must be >= 0")
    if any(sum(r) > length for r in rows):
        raise ValueError(f"a row holds more than length={length} tokens")
    counts = torch.tensor([list(r) for r in rows], dtype=torch.long).reshape(len(rows), 3)
    p, a, b = (counts[:, k:k + 1] for k in range(3))
    idx = torch.arange(length).unsqueeze(0)  # [1, T]
    seg = (idx >= p).long() + (idx >= p + a).long() + (idx >= p + a + b).long()  # [B, T]: 0 prefix .. 3 padding
    q, k = seg.unsqueeze(2), seg.unsqueeze(1)  # [B, T, 1] query, [B, 1, T] key
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & ((k == 0) | (k == q)) & (q < 3)
    allowed |= (q == 3) & torch.eye(length, dtype=torch.bool)
    positions = torch.where(seg == 2, idx - a, idx)
    positions = torch.where(seg == 3, torch.zeros_like(positions), positions)
    return allowed, positions


def join_pair(chosen: Sequence[int], chosen_pos: int, rejected: Sequence[int], rejected_pos: int,
              max_len: int) -> tuple[list[int], tuple[int, int, int], int, int] | None:
    """One sequence for a pair of renderings that share their first tokens: (ids [prefix + chosen tail + rejected
    tail], (prefix, chosen tail, rejected tail) counts for branch_attention, chosen score index, rejected score
    index), or None where the pair must be encoded as two sequences: no token is shared, a score token lies in the
    shared prefix (one rendering starts the other), or either rendering is longer than ``max_len`` (left
    truncation would then cut the two differently)."""
    if len(chosen) > max_len or len(rejected) > max_len:
        return None
    n = shared_prefix_length(chosen, rejected)
    if n == 0 or chosen_pos < n or rejected_pos < n:
        return None
    ids = list(chosen) + list(rejected[n:])
    return ids, (n, len(chosen) - n, len(rejected) - n), chosen_pos, len(chosen) + rejected_pos - n


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """Pairwise reward-model loss: mean of -log sigmoid(r_chosen - r_rejected - margin).

    chosen [N], rejected [N] scalar scores; margin [N] or None (0). Scalar; the same objective as TRL's
    RewardTrainer."""
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    return -F.logsigmoid(diff).mean()


def verdict_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Pointwise term beside :func:`bradley_terry_loss` for judge-labelled pairs, whose chosen step the judge
    accepted and whose rejected step it rejected: mean of (-log sigmoid(r_chosen) - log sigmoid(-r_rejected)) / 2.

    chosen [N], rejected [N] scalar scores -> scalar. Why: Bradley-Terry fixes only differences within a pair, and
    nearly every pair holds two steps of one kind, so each kind's level floats free (a sound subquery may score
    below an unsound answer); a step score read on its own (ProRAG's sigmoid(PRM), RFT's logit >= 0) and a
    comparison across kinds need sound steps above 0 and unsound ones below, which this term asks for."""
    return -(F.logsigmoid(chosen.float()) + F.logsigmoid(-rejected.float())).mean() / 2


def pairwise_accuracy(chosen: Sequence[float], rejected: Sequence[float]) -> float:
    """Share of pairs whose chosen step scores strictly higher; ties count half."""
    if len(chosen) != len(rejected) or not chosen:
        raise ValueError("need as many chosen as rejected scores, at least one")
    return sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected)) / len(chosen)


def auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Area under the ROC curve: probability a positive scores above a negative (ties count half);
    the Mann-Whitney statistic, computed by rank in O(n log n)."""
    if not positive or not negative:
        raise ValueError("AUC needs at least one positive and one negative score")
    scored = sorted([(s, 1) for s in positive] + [(s, 0) for s in negative])
    rank_sum, i = 0.0, 0
    while i < len(scored):  # average ranks over ties
        j = i
        while j < len(scored) and scored[j][0] == scored[i][0]:
            j += 1
        avg = (i + 1 + j) / 2
        rank_sum += avg * sum(lab for _, lab in scored[i:j])
        i = j
    n_pos, n_neg = len(positive), len(negative)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


__all__ = ["auc", "bradley_terry_loss", "branch_attention", "join_pair", "left_truncate", "left_truncate_steps",
           "mean_per_step", "pairwise_accuracy", "predecessors", "written_positions",
           "score_positions", "shared_prefix_length", "verdict_loss"]
