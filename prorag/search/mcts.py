"""The search tree over reasoning steps and one question's search loop, with the model and retrieval behind two
callables (the MCTS stage passes functions that call the policy and retriever services; tests pass a small
deterministic environment). The decisions themselves are pure functions in prorag.algorithms.mcts.

One simulation: descend by PUCT while the node is fully widened; widen (sample ``expansions`` steps, drop
copies of existing siblings: same kind, same normalised content) where progressive widening allows; pick the new
or least-visited child; estimate its value by ``rollouts`` completions (mean terminal reward), or by its own reward
when it ends the trajectory; back the value up the path, discounted per level.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from prorag.algorithms import mcts as alg
from prorag.config import cfg_field
from prorag.trajectory import Step


@dataclass
class MCTSConfig:
    """ProRAG's settings are the defaults where they exist (ANCHORS.md)."""

    simulations: int = cfg_field(200, help="simulations per question (ProRAG: 200)", min=1)
    expansions: int = cfg_field(5, help="steps sampled per widening (ProRAG: 5)", min=1, max=64)
    max_children: int = cfg_field(5, help="most children per node", min=1, max=64)
    widen_alpha: float = cfg_field(0.5, help="progressive widening: a node may hold ceil((visits + 1) ** alpha) "
                                             "children", min=0.0, max=1.0)
    max_depth: int = cfg_field(10, help="deepest step (ProRAG: 10)", min=1, max=64)
    c_puct: float = cfg_field(alg.PUCT_C, help="PUCT exploration constant (ProRAG: 2.5)", min=0.0)
    gamma: float = cfg_field(alg.DISCOUNT, help="discount per level in the backup (ProRAG: 0.99)", min=0.0, max=1.0)
    rollouts: int = cfg_field(1, help="completions averaged per simulation (ProRAG: 1)", min=1, max=64)
    max_tokens: int = cfg_field(0, help="budget: generated tokens per question (0 = no limit)", min=0)
    max_seconds: float = cfg_field(0.0, help="budget: wall seconds per question (0 = no limit)", min=0.0)


@dataclass
class Node:
    step: Step | None  # None at the root
    depth: int
    parent: "Node | None" = None
    children: list["Node"] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0
    terminal: bool = False
    reward: float | None = None  # the terminal reward, for a node that ends the trajectory
    pending: list[Step] = field(default_factory=list)  # sampled, not yet added (widening adds them first)

    @property
    def value(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0

    def history(self) -> list[Step]:
        out, node = [], self
        while node is not None and node.step is not None:
            out.append(node.step)
            node = node.parent
        return out[::-1]

    def to_dict(self) -> dict:
        from prorag.search.pairs import step_to_dict

        return {"step": None if self.step is None else step_to_dict(self.step), "depth": self.depth,
                "visits": self.visits, "value": self.value, "terminal": self.terminal, "reward": self.reward,
                "children": [c.to_dict() for c in self.children]}


#: expand(history, n) -> (up to n sampled next steps, each with its documents when it searched; tokens generated)
Expand = Callable[[Sequence[Step], int], tuple[list[Step], int]]
#: rollout(history) -> (terminal reward of one completion from there; tokens generated)
Rollout = Callable[[Sequence[Step]], tuple[float, int]]
#: reward(history ending in a final answer) -> terminal reward
Reward = Callable[[Sequence[Step]], float]


@dataclass
class SearchStats:
    simulations: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped_by: str = "simulations"


def _ends(step: Step) -> bool:
    return step.kind in ("answer", "invalid")


def step_key(step: Step) -> tuple[str, str]:
    """A step's sibling key (prorag.algorithms.mcts.sibling_key): an invalid step has no content, so its
    generated text stands in (two different malformed samples are two siblings, as the reference keeps them)."""
    return alg.sibling_key(step.kind, step.content if step.valid else step.text)


def pairable(steps: Sequence[Step]) -> list[int]:
    """Indices of the siblings ``steps`` that may make pairs: format-valid, not empty, and the first of each
    sibling key (a copy teaches nothing; an invalid step is no contrast the judge or the PRM should learn)."""
    ok = [i for i, s in enumerate(steps) if s.valid and not s.empty]
    return [ok[k] for k in alg.dedupe_by_key([step_key(steps[i]) for i in ok])]


def search(expand: Expand, rollout: Rollout, reward: Reward, cfg: MCTSConfig,
           clock: Callable[[], float] = time.monotonic) -> tuple[Node, SearchStats]:
    """Run one question's search within its budget; returns (root, stats)."""
    root, stats, start = Node(None, 0), SearchStats(), clock()
    for _ in range(cfg.simulations):
        if cfg.max_tokens and stats.tokens >= cfg.max_tokens:
            stats.stopped_by = "tokens"
            break
        if cfg.max_seconds and clock() - start >= cfg.max_seconds:
            stats.stopped_by = "time"
            break
        # selection: descend while the node may not widen further
        path = [root]
        node = root
        while node.children and not node.terminal and not alg.may_widen(
                len(node.children), node.visits, cfg.max_children, cfg.widen_alpha):
            i = alg.select_child([c.value_sum for c in node.children], [c.visits for c in node.children],
                                 node.visits, c=cfg.c_puct)
            node = node.children[i]
            path.append(node)
        # expansion
        if not node.terminal and node.depth < cfg.max_depth and alg.may_widen(
                len(node.children), node.visits, cfg.max_children, cfg.widen_alpha):
            if not node.pending:
                sampled, tokens = expand(node.history(), cfg.expansions)
                stats.tokens += tokens
                keep = alg.dedupe_by_key([step_key(s) for s in sampled],
                                         existing=[step_key(c.step) for c in node.children])
                node.pending = [sampled[k] for k in keep]
            room = alg.children_allowed(node.visits, cfg.max_children, cfg.widen_alpha) - len(node.children)
            added, node.pending = node.pending[:room], node.pending[room:]
            for step in added:
                child = Node(step, node.depth + 1, parent=node)
                if _ends(child.step) or child.depth >= cfg.max_depth:
                    child.terminal = True
                    child.reward = reward(child.history()) if child.step.kind == "answer" else 0.0
                node.children.append(child)
            fresh = [c for c in node.children if c.visits == 0]
            if fresh:
                node = fresh[0]
                path.append(node)
        # simulation
        if node.terminal:
            value = node.reward or 0.0
        elif node is root and not node.children:
            value = 0.0  # the policy produced nothing to search
        else:
            results = [rollout(node.history()) for _ in range(cfg.rollouts)]
            stats.tokens += sum(t for _, t in results)
            value = alg.mean_reward([r for r, _ in results])
        # backup
        values, visits = alg.backup([n.value_sum for n in path], [n.visits for n in path], value, cfg.gamma)
        for n, v, c in zip(path, values, visits):
            n.value_sum, n.visits = v, c
        stats.simulations += 1
    stats.seconds = clock() - start
    return root, stats


def sibling_sets(root: Node, min_visits: int = 1):
    """Yield (parent, children visited >= min_visits) for every node with two or more such children."""
    stack = [root]
    while stack:
        node = stack.pop()
        visited = [c for c in node.children if c.visits >= min_visits]
        if len(visited) >= 2:
            yield node, visited
        stack.extend(node.children)


def extract_pairs(root: Node, question_id: str, question: str, min_margin: float = 0.01, min_visits: int = 1):
    """Every pair of visited (>= min_visits), format-valid, content-distinct siblings of every sibling set (the
    reference's rule: its judge picks among all of them), in child order (i < j). Each is labelled by the value
    margin when it reaches min_margin either way (else unlabelled, left to the judge); meta says the pair's step
    kind (prorag.algorithms.mcts.pair_kind) and that it came from the search."""
    from prorag.search.pairs import StepPair

    pairs = []
    for parent, kids in sibling_sets(root, min_visits):
        kids = [kids[i] for i in pairable([k.step for k in kids])]
        context = parent.history()
        for i, j in alg.sibling_pairs(len(kids)):
            a, b = kids[i], kids[j]
            pairs.append(StepPair(question_id, question, list(context), (a.step, b.step),
                                  values=(a.value, b.value), visits=(a.visits, b.visits),
                                  value_choice=alg.margin_choice(a.value, b.value, min_margin),
                                  meta={"step_kind": alg.pair_kind(a.step.kind, b.step.kind), "source": "mcts"}))
    return pairs


__all__ = ["MCTSConfig", "Node", "SearchStats", "extract_pairs", "pairable", "search", "sibling_sets", "step_key"]
