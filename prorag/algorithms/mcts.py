"""Monte Carlo tree search over reasoning steps, as pure functions (no model, no retrieval, no I/O).

The search loop (which calls the policy and the retriever) lives in the trainer's MCTS stage; these are the
decisions it takes: which child to descend into (PUCT), whether a node may grow another child (progressive
widening), which sampled steps copy a sibling (same kind, same normalised content), how a simulation's reward is
backed up the path (discounted), how ReasonRAG's shortest-path reward estimation values a tree, and which siblings
form contrastive pairs. Nodes are plain sequences of numbers here; the caller keeps the tree.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

from prorag.metrics import normalize_answer

# ProRAG's reference settings (ANCHORS.md): c = 2.5, uniform prior, gamma = 0.99
PUCT_C = 2.5
DISCOUNT = 0.99


def puct_scores(values: Sequence[float], visits: Sequence[int], parent_visits: int,
                priors: Sequence[float] | None = None, c: float = PUCT_C) -> list[float]:
    """PUCT score of each child: Q + c * P * sqrt(N_parent) / (1 + N_child).

    values [K]: each child's summed backed-up return (Q = values / visits; an unvisited child has Q = 0);
    visits [K]; priors [K] (None = uniform 1/K, as ProRAG). Returns [K] scores.
    """
    k = len(values)
    if len(visits) != k or (priors is not None and len(priors) != k):
        raise ValueError("values, visits and priors must have one entry per child")
    priors = priors if priors is not None else [1.0 / k] * k
    root = math.sqrt(max(parent_visits, 0))
    return [(v / n if n else 0.0) + c * p * root / (1 + n) for v, n, p in zip(values, visits, priors)]


def select_child(values: Sequence[float], visits: Sequence[int], parent_visits: int,
                 priors: Sequence[float] | None = None, c: float = PUCT_C) -> int:
    """Index of the child with the highest PUCT score; ties go to the fewer-visited, then the first child
    (deterministic, so a resumed search takes the same path). At least one child required."""
    if not values:
        raise ValueError("select_child needs at least one child")
    scores = puct_scores(values, visits, parent_visits, priors, c)
    return max(range(len(scores)), key=lambda i: (scores[i], -visits[i], -i))


def may_widen(num_children: int, visits: int, max_children: int, alpha: float = 0.5, k: float = 1.0) -> bool:
    """Progressive widening: a node may grow another child while num_children < min(max_children,
    ceil(k * (visits + 1) ** alpha)). alpha = 0 -> one child; alpha = 1 -> one more per visit.

    Unlike the reference code, which expands a node once and never again, a node that keeps being visited
    keeps gaining siblings, up to max_children."""
    return num_children < children_allowed(visits, max_children, alpha, k)


def children_allowed(visits: int, max_children: int, alpha: float = 0.5, k: float = 1.0) -> int:
    """How many children progressive widening allows a node with ``visits``: min(max_children,
    ceil(k * (visits + 1) ** alpha)) (0 when max_children is 0)."""
    return max(0, min(max_children, math.ceil(k * (visits + 1) ** alpha)))


def discounted_returns(reward: float, depth: int, gamma: float = DISCOUNT) -> list[float]:
    """What a simulation's terminal reward adds to each node on its path: [depth + 1] returns, index 0 the
    root, index depth the node the simulation started from (which gets the reward itself), each level up
    discounted once more: reward * gamma ** (depth - i)."""
    if depth < 0:
        raise ValueError("depth must be >= 0")
    return [reward * gamma ** (depth - i) for i in range(depth + 1)]


def backup(values: Sequence[float], visits: Sequence[int], reward: float,
           gamma: float = DISCOUNT) -> tuple[list[float], list[int]]:
    """Discounted backup along one root-to-leaf path.

    values [D+1] summed returns and visits [D+1] of the path's nodes (root first); returns the updated
    (values, visits): each node gains one visit and reward * gamma ** (levels below it)."""
    if len(values) != len(visits) or not values:
        raise ValueError("values and visits must be non-empty and of one length")
    add = discounted_returns(reward, len(values) - 1, gamma)
    return [v + a for v, a in zip(values, add)], [n + 1 for n in visits]


def mean_reward(rewards: Sequence[float]) -> float:
    """A node's simulation reward from several rollouts: their mean (one rollout is a noisy estimate)."""
    if not rewards:
        raise ValueError("no rollout rewards")
    return sum(rewards) / len(rewards)


def sibling_key(kind: str, content: str) -> tuple[str, str]:
    """What makes two sibling steps the same step: (kind, the project's one answer normalisation of content).

    Only exact copies up to case, punctuation and articles collide (the reference drops exact copies), so two
    sub-answers that differ in one name stay two siblings: that difference is the reading a PRM must learn."""
    return kind, normalize_answer(content)


def dedupe_by_key(keys: Sequence[Hashable], existing: Sequence[Hashable] = ()) -> list[int]:
    """Indices of ``keys`` [K] to keep: the first of each key, and none whose key is among ``existing`` (the
    siblings already kept). Order is kept, so the earliest sample of a step is the one that stays."""
    seen = set(existing)
    keep = []
    for i, key in enumerate(keys):
        if key in seen:
            continue
        seen.add(key)
        keep.append(i)
    return keep


def sibling_pairs(n: int) -> list[tuple[int, int]]:
    """Every unordered pair (i, j), i < j, of ``n`` siblings, in order: n * (n - 1) / 2 pairs (the reference lets
    its judge pick among all visited siblings, so every pair is a candidate contrast)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def margin_choice(value_a: float, value_b: float, min_margin: float = 0.01) -> int | None:
    """The value label of a pair: 0 when a's value exceeds b's by at least min_margin, 1 the other way round,
    None when the margin is smaller (no evidence either way; ReasonRAG's |dr| >= 0.01 rule)."""
    if value_a - value_b >= min_margin:
        return 0
    if value_b - value_a >= min_margin:
        return 1
    return None


def pair_kind(kind_a: str, kind_b: str) -> str:
    """The step kind a pair is counted under: the kind both siblings share, else both kinds sorted and joined by
    '|' (e.g. "answer|subquery": answering now against searching once more)."""
    return kind_a if kind_a == kind_b else "|".join(sorted((kind_a, kind_b)))


def spre_leaf_value(f1: float, steps: int, decay: float = 0.9) -> float:
    """ReasonRAG's shortest-path reward estimation at a finished leaf: F1 * decay ** steps (shorter correct
    paths are worth more)."""
    return f1 * decay ** steps


def spre_internal_value(child_values: Sequence[float], child_visits: Sequence[int]) -> float:
    """ReasonRAG's internal-node value: visit-weighted mean of its children's values,
    sum N_c r_c / sum N_c (0.0 when no child was visited)."""
    total = sum(child_visits)
    if total <= 0:
        return 0.0
    return sum(v * n for v, n in zip(child_values, child_visits)) / total


def value_margin_pairs(values: Sequence[float], visits: Sequence[int], min_margin: float = 0.01,
                       min_visits: int = 1) -> list[tuple[int, int, float]]:
    """Ordered contrastive pairs among siblings by value margin (ReasonRAG's labels).

    values [K] mean values, visits [K]; only siblings visited at least min_visits times count (an estimate
    from no rollout is no evidence). Returns (chosen, rejected, margin) for every ordered pair with margin
    values[chosen] - values[rejected] >= min_margin, largest margin first (ties: lower indices first)."""
    if len(values) != len(visits):
        raise ValueError("values and visits must have one entry per sibling")
    ok = [i for i in range(len(values)) if visits[i] >= min_visits]
    pairs = [(i, j, values[i] - values[j]) for i in ok for j in ok if i != j and values[i] - values[j] >= min_margin]
    return sorted(pairs, key=lambda p: (-p[2], p[0], p[1]))


__all__ = ["DISCOUNT", "PUCT_C", "backup", "children_allowed", "dedupe_by_key", "discounted_returns",
           "margin_choice", "may_widen", "mean_reward", "pair_kind", "puct_scores", "select_child", "sibling_key",
           "sibling_pairs", "spre_internal_value", "spre_leaf_value", "value_margin_pairs"]
