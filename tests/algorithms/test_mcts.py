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


def test_sibling_key_collides_only_on_copies():
    # case, punctuation and articles do not make a different step
    assert (mcts.sibling_key("subquery", "Who founded Acme Corp?")
            == mcts.sibling_key("subquery", "who founded acme corp"))
    assert mcts.sibling_key("answer", "The Red Harbour") == ("answer", "red harbour")
    # one name differs: two steps (the reading contrast), as does the same content under another kind
    assert mcts.sibling_key("subanswer", "Tova Lunn") != mcts.sibling_key("subanswer", "Tova Lind")
    assert mcts.sibling_key("subanswer", "Edraand") != mcts.sibling_key("answer", "Edraand")


def test_dedupe_by_key_keeps_the_first_of_each_key():
    keys = [("q", "a"), ("q", "b"), ("q", "a"), ("a", "a"), ("q", "b")]
    assert mcts.dedupe_by_key(keys) == [0, 1, 3]
    # against siblings already kept
    assert mcts.dedupe_by_key(keys, existing=[("q", "b")]) == [0, 3]
    assert mcts.dedupe_by_key([]) == []


def test_sibling_pairs_are_every_unordered_pair():
    assert mcts.sibling_pairs(3) == [(0, 1), (0, 2), (1, 2)]
    assert len(mcts.sibling_pairs(5)) == 10
    assert mcts.sibling_pairs(1) == [] and mcts.sibling_pairs(0) == []
    with pytest.raises(ValueError):
        mcts.sibling_pairs(-1)


def test_margin_choice_either_way():
    assert mcts.margin_choice(0.9, 0.2) == 0
    assert mcts.margin_choice(0.2, 0.9) == 1
    assert mcts.margin_choice(0.5, 0.505) is None
    assert mcts.margin_choice(0.5, 0.505, min_margin=0.001) == 1


def test_pair_kind():
    assert mcts.pair_kind("subanswer", "subanswer") == "subanswer"
    assert mcts.pair_kind("subquery", "answer") == mcts.pair_kind("answer", "subquery") == "answer|subquery"


def test_spre_values():
    assert mcts.spre_leaf_value(1.0, 2) == pytest.approx(0.81)
    assert mcts.spre_internal_value([1.0, 0.0], [3, 1]) == pytest.approx(0.75)
    assert mcts.spre_internal_value([1.0], [0]) == 0.0


def test_value_margin_pairs():
    pairs = mcts.value_margin_pairs([0.9, 0.2, 0.5, 0.95], [3, 2, 1, 0], min_margin=0.1)
    # sibling 3 was never visited and does not count
    assert [(c, r) for c, r, _ in pairs] == [(0, 1), (0, 2), (2, 1)]
    assert pairs[0][2] == pytest.approx(0.7)
    assert mcts.value_margin_pairs([0.5, 0.505], [1, 1]) == []
    assert math.isclose(mcts.value_margin_pairs([0.0, 1.0], [1, 1])[0][2], 1.0)
