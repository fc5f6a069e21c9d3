"""Run by tests/training/test_distributed.py under torchrun with 2 gloo processes: a stage's end as the launcher
reaches it. A model prepared by accelerate (DDP-wrapped) and trained inside a function is garbage once the
function returns, but held by a reference cycle (as a training loop with hooks is) and, with the collector off,
alive; finish_distributed must free it while the process group still exists. Each process writes to argv[1]
whether the wrapper was alive before and after finish_distributed, and whether the group was then gone."""

import gc
import json
import sys
import weakref
from pathlib import Path

import torch

from prorag.training.distributed import accelerator_from_env, finish_distributed


def train_and_drop(accelerator) -> weakref.ref:
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    holder: dict = {"model": model}
    holder["self"] = holder  # the cycle
    return weakref.ref(model)


def main(out: str) -> None:
    gc.disable()  # no collection but the one finish_distributed makes, so the test does not pass by chance
    accelerator = accelerator_from_env(cpu=True)
    wrapper = train_and_drop(accelerator)
    alive_before = wrapper() is not None
    rank = accelerator.process_index
    finish_distributed(accelerator)
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "alive_before": alive_before, "alive_after": wrapper() is not None,
        "group_after": torch.distributed.is_initialized()}))


if __name__ == "__main__":
    main(sys.argv[1])
