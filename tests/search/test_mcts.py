"""One question's MCTS (prorag.search.mcts) in a small deterministic environment: the search finds the sound path,
widens progressively, keeps its budget, and its pairs prefer the sound sibling."""

import json

import pytest

from prorag.search.mcts import MCTSConfig, Node, extract_pairs, search
from prorag.trajectory import Step

GOOD = [Step("subquery", content="Who founded Mai Brewery?", docs=[]), Step("subanswer", content="Tova Lunn"),
        Step("answer", content="Edraand")]
BAD = [Step("subquery", content="Who founded Tova Lunn?", docs=[]), Step("subanswer", content="Kora Vell"),
       Step("answer", content="Balorn")]
DUP = [Step("subquery", content="who founded mai brewery", docs=[]), Step("subanswer", content="tova lunn"),
       Step("answer", content="edraand")]


def _sound(history):
    return all(s.content == GOOD[i].content for i, s in enumerate(history))


def expand(history, n):
    d = len(history)
    return [BAD[d], GOOD[d], DUP[d], Step("invalid", text=f"junk {d}")][:n], 10 * n


def rollout(history):
    return (1.0 if _sound(history) else 0.0), 7


def reward(history):
    return 1.0 if history[-1].content == "Edraand" and _sound(history) else 0.0


def test_search_prefers_the_sound_path_and_its_pairs_say_so():
    cfg = MCTSConfig(simulations=60, expansions=4, max_children=3, widen_alpha=0.5, max_depth=5)
    root, stats = search(expand, rollout, reward, cfg)
    assert stats.simulations == 60 and stats.stopped_by == "simulations" and stats.tokens > 0
    assert root.visits == 60
    best = max(root.children, key=lambda c: c.visits)
    assert best.step.content == GOOD[0].content
    # the copy "who founded mai brewery" (same kind, same normalised content) was dropped among the root's siblings
    assert sum(c.step.content.lower().rstrip("?") == "who founded mai brewery" for c in root.children) == 1
    assert len(root.children) <= 3
    pairs = extract_pairs(root, "q1", "Q?")
    for p in pairs:
        margin = p.values[0] - p.values[1]
        assert p.value_choice == (0 if margin >= 0.01 else 1 if margin <= -0.01 else None)
        assert p.steps[0].valid and p.steps[1].valid and p.meta["source"] == "mcts"
    top = next(p for p in pairs if not p.context and GOOD[0].content in (p.steps[0].content, p.steps[1].content))
    assert top.steps[top.value_choice].content == GOOD[0].content
    json.dumps(root.to_dict())  # trees are saved as JSON


def _node(parent, step, visits, value):
    child = Node(step, parent.depth + 1, parent=parent, visits=visits, value_sum=value * visits)
    parent.children.append(child)
    return child


def test_extract_pairs_takes_every_valid_distinct_visited_pair():
    root = Node(None, 0, visits=20)
    q = _node(root, Step("subquery", content="Who founded Mai Brewery?", docs=[]), 12, 0.6)
    _node(root, Step("subquery", content="Who founded Tova Lunn?", docs=[]), 5, 0.1)
    _node(root, Step("invalid", text="<subquery>unclosed"), 2, 0.0)          # invalid: never in a pair
    _node(root, Step("subquery", content="who founded the Mai Brewery", docs=[]), 1, 0.0)  # a copy of the first
    _node(root, Step("answer", content="Edraand"), 0, 0.0)                   # never visited
    # under the first subquery: two sub-answers that differ in one name, and one as good as the first
    _node(q, Step("subanswer", content="Tova Lunn"), 6, 0.9)
    _node(q, Step("subanswer", content="Tova Lind"), 4, 0.0)
    _node(q, Step("subanswer", content="Tova Lunn's brother"), 2, 0.9)
    pairs = extract_pairs(root, "q1", "Q?", min_margin=0.01)
    top = [p for p in pairs if not p.context]
    below = [p for p in pairs if p.context]
    # at the root only the two distinct valid subqueries pair: the invalid sibling, the copy (the first kept)
    # and the unvisited answer do not
    assert [(p.steps[0].content, p.steps[1].content) for p in top] == [("Who founded Mai Brewery?",
                                                                       "Who founded Tova Lunn?")]
    assert top[0].value_choice == 0 and top[0].visits == (12, 5) and top[0].values == pytest.approx((0.6, 0.1))
    assert top[0].meta == {"step_kind": "subquery", "source": "mcts"}
    # below it every pair of the three sub-answers, in child order, both one-name variants kept
    assert [(p.steps[0].content, p.steps[1].content) for p in below] == [
        ("Tova Lunn", "Tova Lind"), ("Tova Lunn", "Tova Lunn's brother"), ("Tova Lind", "Tova Lunn's brother")]
    assert [p.value_choice for p in below] == [0, None, 1]  # labelled either way, or left to the judge
    assert all(p.context[0].content == "Who founded Mai Brewery?" and p.meta["step_kind"] == "subanswer"
               for p in below)
    # min_visits: the sub-answer visited twice drops out at 3
    assert len([p for p in extract_pairs(root, "q1", "Q?", min_visits=3) if p.context]) == 1


def test_extract_pairs_counts_a_mixed_pair_under_both_kinds():
    root = Node(None, 0, visits=4)
    _node(root, Step("subquery", content="Who founded Mai Brewery?", docs=[]), 2, 0.5)
    _node(root, Step("answer", content="Edraand"), 2, 0.5)
    [pair] = extract_pairs(root, "q1", "Q?")
    assert pair.meta["step_kind"] == "answer|subquery" and pair.value_choice is None


def test_progressive_widening_adds_children_as_visits_grow():
    cfg = MCTSConfig(simulations=1, expansions=4, max_children=3, widen_alpha=0.5)
    root, _ = search(expand, rollout, reward, cfg)
    assert len(root.children) == 1  # ceil(sqrt(1)) at the first visit
    root, _ = search(expand, rollout, reward, MCTSConfig(simulations=9, expansions=4, max_children=3))
    assert len(root.children) == 3


@pytest.mark.parametrize("budget, stopped", [({"max_tokens": 50}, "tokens"), ({"max_seconds": 1.0}, "time")])
def test_budget_stops_the_search(budget, stopped):
    ticks = iter(range(1000))
    root, stats = search(expand, rollout, reward, MCTSConfig(simulations=500, **budget),
                         clock=lambda: float(next(ticks)) * 0.3)
    assert stats.stopped_by == stopped and stats.simulations < 500
