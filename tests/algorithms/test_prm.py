"""prorag.algorithms.prm against hand-computed values."""

import math

import pytest
import torch

from prorag.algorithms import prm
from prorag.tokens import StepSpan


def test_score_positions_are_each_steps_last_token():
    spans = [StepSpan(5, 9, 20), StepSpan(20, 26, 26)]
    assert prm.score_positions(spans) == [19, 25]
    with pytest.raises(ValueError):
        prm.score_positions([StepSpan(4, 4, 4)])


def test_left_truncate_keeps_prefix_and_newest_step():
    ids = list(range(10))
    out, pos = prm.left_truncate(ids, [3, 5, 9], max_len=6, keep_prefix=2)
    # 4 tokens cut right after the prefix [0, 1]: [0, 1, 6, 7, 8, 9]
    assert out == [0, 1, 6, 7, 8, 9]
    assert pos == [None, None, 5]
    assert out[pos[-1]] == ids[9]
    # short sequences are untouched
    assert prm.left_truncate(ids, [9], max_len=10) == (ids, [9])
    # a prefix longer than the room shrinks, never the newest token
    out, pos = prm.left_truncate(ids, [9], max_len=3, keep_prefix=8)
    assert len(out) == 3 and out[pos[0]] == 9
    with pytest.raises(ValueError):
        prm.left_truncate(ids, [9], max_len=0)


def test_bradley_terry_loss():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    want = (-math.log(1 / (1 + math.exp(-2.0))) + math.log(2.0)) / 2
    assert prm.bradley_terry_loss(c, r).item() == pytest.approx(want, rel=1e-6)
    assert prm.bradley_terry_loss(c, r, margin=torch.tensor([2.0, 0.0])).item() == pytest.approx(math.log(2.0))


def test_pairwise_accuracy_and_auc():
    assert prm.pairwise_accuracy([1.0, 0.0, 2.0], [0.0, 1.0, 2.0]) == pytest.approx(0.5)
    assert prm.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert prm.auc([0.1], [0.9]) == 0.0
    # ties count half: positives [0.5, 0.9] vs negatives [0.5, 0.1] -> (0.5 + 1 + 1 + 1) / 4
    assert prm.auc([0.5, 0.9], [0.5, 0.1]) == pytest.approx(0.875)
    with pytest.raises(ValueError):
        prm.auc([], [0.1])


def test_shared_prefix_length_compares_ids():
    assert prm.shared_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert prm.shared_prefix_length([1, 2], [1, 2, 3]) == 2
    assert prm.shared_prefix_length([7], [1]) == 0
    assert prm.shared_prefix_length([], [1]) == 0


def test_branch_attention_by_hand():
    # row 0: prefix 2, chosen 2, rejected 1, one padding token; row 1: a plain sequence of 3, then padding
    allowed, positions = prm.branch_attention([(2, 2, 1), (3, 0, 0)], 6)
    assert allowed.shape == (2, 6, 6) and allowed.dtype == torch.bool and positions.shape == (2, 6)
    expect0 = [[1, 0, 0, 0, 0, 0],
               [1, 1, 0, 0, 0, 0],
               [1, 1, 1, 0, 0, 0],  # chosen: the prefix and itself, causally
               [1, 1, 1, 1, 0, 0],
               [1, 1, 0, 0, 1, 0],  # rejected: the prefix and itself, never the chosen tokens
               [0, 0, 0, 0, 0, 1]]  # padding: only itself
    expect1 = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
               [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert allowed[0].int().tolist() == expect0
    assert allowed[1].int().tolist() == expect1
    # the rejected step continues the prefix at position 2, as in a sequence of its own
    assert positions.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 0, 0, 0]]
    # every query attends to at least one key (softmax stays defined), none to a later one
    assert allowed.any(-1).all() and not (allowed & ~torch.ones(6, 6, dtype=torch.bool).tril()).any()
    with pytest.raises(ValueError):
        prm.branch_attention([(4, 2, 1)], 6)
    with pytest.raises(ValueError):
        prm.branch_attention([(2, -1, 1)], 6)


def test_join_pair_and_when_it_declines():
    ids, counts, c_at, r_at = prm.join_pair([1, 2, 3, 4], 3, [1, 2, 5, 6, 7], 4, max_len=8)
    assert ids == [1, 2, 3, 4, 5, 6, 7] and counts == (2, 2, 3)
    assert ids[c_at] == 4 and ids[r_at] == 7
    # a score position before the renderings' end reads from its own branch
    assert prm.join_pair([1, 2, 3, 4], 2, [1, 2, 5, 6, 7], 3, max_len=8)[2:] == (2, 5)
    assert prm.join_pair([9, 2, 3], 2, [1, 2, 3], 2, max_len=8) is None  # nothing shared
    assert prm.join_pair([1, 2, 3], 2, [1, 2, 3, 4], 3, max_len=8) is None  # chosen's score token is shared
    assert prm.join_pair([1, 2, 3], 2, [1, 2, 4], 2, max_len=2) is None  # truncation would cut them apart
