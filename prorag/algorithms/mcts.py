"""Monte Carlo tree search over reasoning steps, as pure functions (no model, no retrieval, no I/O).

The search loop (which calls the policy and the retriever) lives in the trainer's MCTS stage; these are the
decisions it takes: which child to descend into (PUCT), whether a node may grow another child (progressive
widening), which sampled steps are near-duplicates of their siblings, how a simulation's reward is backed up
the path (discounted), how ReasonRAG's shortest-path reward estimation values a tree, and which siblings form
a contrastive pair. Nodes are plain sequences of numbers here; the caller keeps the tree.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

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


_WORD = re.compile(r"\w+")


def step_tokens(text: str) -> frozenset[str]:
    """Lower-cased word set of a step, what near-duplicate detection compares."""
    return frozenset(_WORD.findall(text.lower()))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a & b| / |a | b|; two empty sets are identical (1.0)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def dedupe_siblings(texts: Sequence[str], threshold: float = 0.9,
                    existing: Sequence[str] = ()) -> list[int]:
    """Indices of ``texts`` to keep as new siblings: a text is dropped when its word-set Jaccard similarity
    to an existing sibling or to an earlier kept text is >= threshold (the reference only drops exact
    copies; sampled steps often differ by a word of filler). threshold > 1 keeps everything."""
    kept_sets = [step_tokens(t) for t in existing]
    keep = []
    for i, text in enumerate(texts):
        s = step_tokens(text)
        if any(jaccard(s, o) >= threshold for o in kept_sets):
            continue
        kept_sets.append(s)
        keep.append(i)
    return keep


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
    """Contrastive pairs among siblings by value margin (ReasonRAG's labels; ProRAG's pairs before judging).

    values [K] mean values, visits [K]; only siblings visited at least min_visits times count (an estimate
    from no rollout is no evidence). Returns (chosen, rejected, margin) for every ordered pair with margin
    values[chosen] - values[rejected] >= min_margin, largest margin first (ties: lower indices first)."""
    if len(values) != len(visits):
        raise ValueError("values and visits must have one entry per sibling")
    ok = [i for i in range(len(values)) if visits[i] >= min_visits]
    pairs = [(i, j, values[i] - values[j]) for i in ok for j in ok if i != j and values[i] - values[j] >= min_margin]
    return sorted(pairs, key=lambda p: (-p[2], p[0], p[1]))


def best_worst_pair(values: Sequence[float], visits: Sequence[int], min_margin: float = 0.01,
                    min_visits: int = 1) -> tuple[int, int, float] | None:
    """The one pair ProRAG keeps per sibling set for the judge: the best against the worst sibling, or None
    when fewer than two qualify or their margin is below min_margin."""
    pairs = value_margin_pairs(values, visits, min_margin, min_visits)
    return pairs[0] if pairs else None


__all__ = ["DISCOUNT", "PUCT_C", "backup", "best_worst_pair", "children_allowed", "dedupe_siblings", "discounted_returns", "jaccard",
           "may_widen", "mean_reward", "puct_scores", "select_child", "spre_internal_value", "spre_leaf_value",
           "step_tokens", "value_margin_pairs"]
