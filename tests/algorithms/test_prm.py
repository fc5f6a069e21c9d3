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
