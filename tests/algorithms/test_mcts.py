"""prorag.algorithms.mcts against hand-computed values."""

import math

import pytest

from prorag.algorithms import mcts


def test_puct_scores_hand_computed():
    # child 0: Q = 1.0/2 = 0.5, bonus 2.5 * 0.5 * sqrt(4) / 3 = 0.8333; child 1 unvisited: 0 + 2.5 * 0.5 * 2 / 1
    s = mcts.puct_scores([1.0, 0.0], [2, 0], parent_visits=4)
    assert s[0] == pytest.approx(0.5 + 2.5 * 0.5 * 2 / 3)
    assert s[1] == pytest.approx(2.5)


def test_select_child_prefers_unvisited_then_value():
    assert mcts.select_child([1.0, 0.0], [2, 0], parent_visits=4) == 1
    # with c = 0 only Q counts: 0.9/1 beats 1.0/2
    assert mcts.select_child([1.0, 0.9], [2, 1], parent_visits=3, c=0.0) == 1
    # a tie goes to the fewer-visited child
    assert mcts.select_child([0.5, 1.0], [1, 2], parent_visits=3, c=0.0) == 0


def test_select_child_uses_priors():
    assert mcts.select_child([0.0, 0.0], [0, 0], parent_visits=1, priors=[0.2, 0.8]) == 1
    with pytest.raises(ValueError):
        mcts.select_child([], [], parent_visits=1)
    with pytest.raises(ValueError):
        mcts.puct_scores([0.0], [0, 1], parent_visits=1)


def test_may_widen():
    # alpha 0.5, k 1: ceil(sqrt(visits + 1)) children allowed
    assert mcts.may_widen(0, 0, max_children=5)
    assert not mcts.may_widen(1, 0, max_children=5)
    assert mcts.may_widen(1, 3, max_children=5)        # ceil(sqrt(4)) = 2
    assert not mcts.may_widen(2, 3, max_children=5)
    assert not mcts.may_widen(5, 1000, max_children=5)  # capped
    assert not mcts.may_widen(0, 10, max_children=0)


def test_backup_discounts_each_level():
    values, visits = mcts.backup([0.0, 0.0, 1.0], [3, 1, 0], reward=0.5, gamma=0.9)
    assert values == pytest.approx([0.5 * 0.81, 0.5 * 0.9, 1.5])
    assert visits == [4, 2, 1]
    assert mcts.discounted_returns(1.0, 0) == [1.0]
    with pytest.raises(ValueError):
        mcts.backup([], [], 1.0)


def test_mean_reward():
    assert mcts.mean_reward([0.0, 1.0, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mcts.mean_reward([])


def test_dedupe_siblings_drops_near_duplicates():
    texts = ["Who founded Acme Corp?", "who founded acme corp", "Where was Bob born?", "Who founded Acme Corp ?"]
    assert mcts.dedupe_siblings(texts) == [0, 2]
    # against siblings already in the tree
    assert mcts.dedupe_siblings(["Where was Bob born?"], existing=["where was bob born"]) == []
    assert mcts.dedupe_siblings(texts, threshold=1.1) == [0, 1, 2, 3]
    assert mcts.jaccard(frozenset({"a", "b"}), frozenset({"b", "c"})) == pytest.approx(1 / 3)


def test_spre_values():
    assert mcts.spre_leaf_value(1.0, 2) == pytest.approx(0.81)
    assert mcts.spre_internal_value([1.0, 0.0], [3, 1]) == pytest.approx(0.75)
    assert mcts.spre_internal_value([1.0], [0]) == 0.0


def test_value_margin_pairs_and_best_worst():
    pairs = mcts.value_margin_pairs([0.9, 0.2, 0.5, 0.95], [3, 2, 1, 0], min_margin=0.1)
    # sibling 3 was never visited and does not count
    assert [(c, r) for c, r, _ in pairs] == [(0, 1), (0, 2), (2, 1)]
    assert pairs[0][2] == pytest.approx(0.7)
    assert mcts.best_worst_pair([0.9, 0.2, 0.5], [1, 1, 1])[:2] == (0, 1)
    assert mcts.best_worst_pair([0.5, 0.505], [1, 1]) is None
    assert mcts.best_worst_pair([0.5], [1]) is None
    assert math.isclose(mcts.best_worst_pair([0.0, 1.0], [1, 1])[2], 1.0)
