"""Weighted token cross-entropy against hand-computed values."""

import math

import pytest
import torch

from prorag.algorithms import lookup
from prorag.algorithms.losses import IGNORE_INDEX, LOSSES, weighted_token_ce
from prorag.errors import InvalidArgument

LN2 = math.log(2.0)


def test_weighted_mean_of_token_cross_entropies():
    # token 0: logits (0, 0), target 0 -> CE ln 2; token 1: logits (ln 3, 0), target 1 -> CE -ln(1/4) = 2 ln 2
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    loss, n = weighted_token_ce(logits, torch.tensor([0, 1]), torch.tensor([1.0, 3.0]))
    assert n == 2
    assert loss.item() == pytest.approx((1 * LN2 + 3 * 2 * LN2) / 4)  # = 7/4 ln 2
    plain, _ = weighted_token_ce(logits, torch.tensor([0, 1]), torch.ones(2))
    assert plain.item() == pytest.approx(1.5 * LN2)


def test_ignored_targets_and_leading_shape():
    # [B=1, T=3, V=2]; the first position is not trained, whatever its logits and weight
    logits = torch.tensor([[[9.0, -9.0], [0.0, 0.0], [math.log(3.0), 0.0]]])
    targets = torch.tensor([[IGNORE_INDEX, 0, 1]])
    loss, n = weighted_token_ce(logits, targets, torch.tensor([[100.0, 1.0, 3.0]]))
    assert n == 2 and loss.item() == pytest.approx(7 / 4 * LN2)


def test_half_precision_logits_are_computed_in_fp32_and_nothing_trained_is_zero():
    logits = torch.tensor([[0.0, 0.0]], dtype=torch.bfloat16)
    loss, n = weighted_token_ce(logits, torch.tensor([1]), torch.tensor([2.0]))
    assert loss.dtype == torch.float32 and n == 1 and loss.item() == pytest.approx(LN2, rel=1e-6)
    loss, n = weighted_token_ce(logits, torch.tensor([IGNORE_INDEX]), torch.tensor([2.0]))
    assert n == 0 and loss.item() == 0.0


def test_gradient_of_a_single_token():
    # d CE / d logits = softmax - onehot: (0.5 - 1, 0.5) for logits (0, 0) and target 0
    logits = torch.zeros(1, 2, requires_grad=True)
    loss, _ = weighted_token_ce(logits, torch.tensor([0]), torch.tensor([4.0]))
    loss.backward()
    assert torch.allclose(logits.grad, torch.tensor([[-0.5, 0.5]]))


def test_selected_by_name():
    assert lookup(LOSSES, "loss", "weighted_token_ce") is weighted_token_ce
    with pytest.raises(InvalidArgument, match="unknown loss 'dpo' \\(known: weighted_token_ce\\)"):
        lookup(LOSSES, "loss", "dpo")
