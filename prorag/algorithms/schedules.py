"""Learning-rate schedules as pure functions of the step: ``fn(step, total_steps, warmup_steps) -> factor``.

The factor multiplies the optimizer's peak learning rate; ``step`` counts optimizer steps from 0
(the factor used by the step that follows). A function of the step alone, so a resumed run's
learning rate is exactly an uninterrupted run's.
"""

from __future__ import annotations

import math
from typing import Callable

from prorag.algorithms import lookup

Schedule = Callable[[int, int, int], float]


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to 1 over ``warmup_steps`` ((step + 1) / warmup_steps), then cosine decay to 0
    at ``total_steps``. With no warm-up it is plain cosine annealing (torch's CosineAnnealingLR, eta_min 0)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def constant(step: int, total_steps: int, warmup_steps: int) -> float:
    """1 after an optional linear ramp ((step + 1) / warmup_steps over the first ``warmup_steps``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


#: name -> schedule, for configuration
SCHEDULES: dict[str, Schedule] = {"warmup_cosine": warmup_cosine, "constant": constant}


def get_schedule(name: str) -> Schedule:
    return lookup(SCHEDULES, "schedule", name)


__all__ = ["SCHEDULES", "Schedule", "constant", "get_schedule", "warmup_cosine"]
