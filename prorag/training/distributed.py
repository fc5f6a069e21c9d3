"""The one training loop on several processes, through Hugging Face accelerate (an existing distributed engine:
DDP by default, FSDP2 or DeepSpeed ZeRO-3 by its config file on GPU hosts).

How a run is launched: ``accelerate launch [--config_file k8s/accelerate/fsdp2.yaml] -m prorag.training.launch
...`` (or torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR for every process on every node; then
:func:`accelerator_from_env` gives the loop an ``Accelerator`` and :func:`prorag.training.loop.run_loop` splits
each optimizer step's micro-batches over the processes. One process (no WORLD_SIZE, or 1) runs without it.

Why micro-batches and not samples are what is split: a stage's ``batch_at(i)`` is a pure function of i, so
giving process r the micro-batches i with i mod world == r (within a step) keeps a resumed or re-sharded run
on exactly the batches a single process sees, and the step's gradient is the same mean over them.
"""

from __future__ import annotations

import os


def world_size_from_env() -> int:
    """Processes in the launched job (1 when not launched by accelerate / torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def accelerator_from_env(cpu: bool | None = None):
    """An ``accelerate.Accelerator`` when this process is one of several (WORLD_SIZE > 1), else None.

    cpu: force the CPU (gloo) backend; None = accelerate's choice (CUDA when present). Mixed precision and the
    sharding strategy come from accelerate's own configuration (its config file or ACCELERATE_* variables)."""
    if world_size_from_env() <= 1:
        return None
    from accelerate import Accelerator

    return Accelerator(cpu=bool(cpu)) if cpu is not None else Accelerator()


def finish_distributed(accelerator) -> None:
    """End a launched process's part cleanly: wait for every process, then destroy the process group
    (accelerate's ``end_training``). Why: a process that exits with the group alive can abort in teardown
    ("terminate called without an active exception", SIGABRT) while gloo's threads still run, failing a job
    whose work was done. None (one process) does nothing."""
    if accelerator is None:
        return
    accelerator.wait_for_everyone()
    accelerator.end_training()


def my_micro_batches(step: int, grad_accum: int, rank: int, world: int) -> list[int]:
    """The micro-batch indices process ``rank`` of ``world`` computes for optimizer step ``step``.

    Step s is made of micro-batches s*k .. s*k + k - 1 (k = grad_accum); process r takes those with offset
    j = r, r + world, ... so together the processes cover each exactly once. Requires world to divide k.

    >>> my_micro_batches(2, 4, 0, 2), my_micro_batches(2, 4, 1, 2), my_micro_batches(0, 3, 0, 1)
    ([8, 10], [9, 11], [0, 1, 2])
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} processes")
    if grad_accum % world:
        raise ValueError(f"grad_accum ({grad_accum}) must be a multiple of the number of processes ({world})")
    return list(range(step * grad_accum + rank, (step + 1) * grad_accum, world))


__all__ = ["accelerator_from_env", "finish_distributed", "my_micro_batches", "world_size_from_env"]
