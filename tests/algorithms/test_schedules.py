"""Learning-rate schedules against hand-computed values (and torch's cosine annealing)."""

import math

import pytest
import torch

from prorag.algorithms.schedules import SCHEDULES, constant, get_schedule, warmup_cosine
from prorag.errors import InvalidArgument


def test_warmup_cosine_ramps_linearly_then_decays_to_zero():
    # 2 warm-up steps of 10: 1/2, 2/2, then cos over the remaining 8
    assert [warmup_cosine(s, 10, 2) for s in (0, 1)] == [0.5, 1.0]
    assert warmup_cosine(2, 10, 2) == 1.0
    assert warmup_cosine(4, 10, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert warmup_cosine(6, 10, 2) == pytest.approx(0.5)
    assert warmup_cosine(10, 10, 2) == pytest.approx(0.0)
    assert warmup_cosine(12, 10, 2) == pytest.approx(0.0)  # past the end it stays at 0


def test_warmup_cosine_without_warmup_is_torch_cosine_annealing():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)
    for step in range(8):  # through T_max; past it torch's cosine rises again, a run never gets there
        assert 0.05 * warmup_cosine(step, 7, 0) == pytest.approx(sched.get_last_lr()[0], abs=1e-12), step
        opt.step()
        sched.step()


def test_constant_with_and_without_a_ramp():
    assert [constant(s, 100, 4) for s in (0, 1, 2, 3, 4, 99)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant(0, 100, 0) == 1.0


def test_selected_by_name():
    assert set(SCHEDULES) == {"warmup_cosine", "constant"}
    assert get_schedule("constant") is constant
    with pytest.raises(InvalidArgument, match="unknown schedule 'linear' \\(known: constant, warmup_cosine\\)"):
        get_schedule("linear")
