"""One question's MCTS (prorag.mcts) in a small deterministic environment: the search finds the sound path,
widens progressively, keeps its budget, and its pairs prefer the sound sibling."""

import json

import pytest

from prorag.mcts import MCTSConfig, extract_pairs, search
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
    # the near-duplicate "who founded mai brewery" was dropped among the root's siblings
    assert sum(c.step.content.lower() == "who founded mai brewery?" for c in root.children) == 1
    assert len(root.children) <= 3
    pairs = extract_pairs(root, "q1", "Q?")
    assert pairs and all(p.value_choice == 0 for p in pairs if p.values[0] - p.values[1] >= 0.01)
    top = next(p for p in pairs if not p.context)
    assert top.steps[0].content == GOOD[0].content and top.value_choice == 0
    json.dumps(root.to_dict())  # trees are saved as JSON


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
