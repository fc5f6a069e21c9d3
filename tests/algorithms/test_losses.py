"""Weighted token cross-entropy against hand-computed values."""

import math

import pytest
import torch

from prorag.algorithms import lookup
from prorag.algorithms.losses import IGNORE_INDEX, LOSSES, linear_ce_sum, weighted_linear_ce, weighted_token_ce
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


def test_an_ignored_position_gets_no_gradient_and_the_others_the_weighted_mean_s():
    # [B=1, T=3, V=2]: position 0 ignored (large weight, extreme logits), positions 1 and 2 weighted 1 and 3
    logits = torch.tensor([[[9.0, -9.0], [0.0, 0.0], [0.0, 0.0]]], requires_grad=True)
    loss, _ = weighted_token_ce(logits, torch.tensor([[IGNORE_INDEX, 0, 1]]), torch.tensor([[100.0, 1.0, 3.0]]))
    loss.backward()
    # d loss / d logits_t = w_t / sum(w) * (softmax - onehot)
    expected = torch.tensor([[[0.0, 0.0], [-0.5 / 4, 0.5 / 4], [3 * 0.5 / 4, -3 * 0.5 / 4]]])
    assert torch.allclose(logits.grad, expected)


def test_selected_by_name():
    assert lookup(LOSSES, "loss", "weighted_token_ce") is weighted_token_ce
    with pytest.raises(InvalidArgument, match="unknown loss 'dpo' \\(known: weighted_token_ce\\)"):
        lookup(LOSSES, "loss", "dpo")


def _head_case(seed: int = 0):
    """hidden [12, 8], head [16, 8], targets with two ignored, weights from the format loss's few values (one 0)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(12, 8, generator=g, requires_grad=True)
    head = torch.randn(16, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 16, (12,), generator=g)
    targets[[2, 7]] = IGNORE_INDEX
    weights = torch.tensor([1.0, 2.0, 1.0, 0.5, 0.0, 1.0, 2.0, 5.0, 1.0, 0.5, 2.0, 1.0])
    return hidden, head, targets, weights


def test_weighted_linear_ce_equals_the_head_then_weighted_token_ce_in_value_and_gradients():
    hidden, head, targets, weights = _head_case()
    ref, n_ref = weighted_token_ce(hidden @ head.T, targets, weights)
    ref_grads = torch.autograd.grad(ref, (hidden, head))
    loss, n = weighted_linear_ce(hidden, head, targets, weights)
    grads = torch.autograd.grad(loss, (hidden, head))
    assert n == n_ref == 10
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-6)


def test_weighted_linear_ce_sums_each_weight_once_over_its_rows_only():
    hidden, head, targets, weights = _head_case(1)
    calls = []

    def counting_sum_ce(h, w, t):
        calls.append(len(t))
        return linear_ce_sum(h, w, t)

    weighted_linear_ce(hidden, head, targets, weights, sum_ce=counting_sum_ce)
    # kept rows: weight 1 x4, 2 x3, 0.5 x2, 0 x1 (the ignored rows 2 and 7 take a 1 and the only 5); 0 is skipped
    assert sorted(calls) == [2, 3, 4]


def test_weighted_linear_ce_with_nothing_trained_is_zero_and_still_differentiable():
    hidden, head, targets, weights = _head_case()
    loss, n = weighted_linear_ce(hidden, head, torch.full_like(targets, IGNORE_INDEX), weights)
    assert n == 0 and loss.item() == 0.0
    loss.backward()
    assert hidden.grad is not None and float(hidden.grad.abs().sum()) == 0.0
