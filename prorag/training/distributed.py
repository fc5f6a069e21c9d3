"""The one training loop on several processes, through Hugging Face accelerate (an existing distributed engine:
DDP by default, FSDP2 by its config file on GPU hosts).

How a run is launched: ``accelerate launch [--config_file configs/accelerate/fsdp2.yaml] -m
services.trainer.launch STAGE CONFIG.json WORK_DIR`` (or torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR
for every process on every node; then :func:`accelerator_from_env` gives the loop an ``Accelerator`` and
:func:`prorag.training.loop.run_loop` splits each optimizer step's micro-batches over the processes. One process
(no WORLD_SIZE, or 1, and no sharding engine asked for) runs without it.

Why micro-batches and not samples are what is split: a stage's ``batch_at(i)`` is a pure function of i, so
giving process r the micro-batches i with i mod world == r (within a step) keeps a resumed or re-sharded run
on exactly the batches a single process sees, and the step's gradient is the same mean over them.

What else a stage does differently on several processes, each through a helper here that is a plain call on one
process: data that comes from the services (the retriever, the policy, the PRM) is fetched by the main process
alone and handed to the others (:func:`from_main`); what is published is gathered from every process's shard
first (:func:`full_state_dict`); a forward pass outside the loop runs inside the engine (:func:`call_in_engine`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

#: how long a process waits in a collective (e.g. for the main process sampling a stage's data through the
#: services, which can take hours) before the job fails; PRORAG_DIST_TIMEOUT_S overrides it
DEFAULT_TIMEOUT_S = 4 * 3600


def world_size_from_env() -> int:
    """Processes in the launched job (1 when not launched by accelerate / torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def sharding_asked() -> bool:
    """Whether ``accelerate launch`` was given an FSDP or DeepSpeed config (its ACCELERATE_USE_* variables)."""
    return any(os.environ.get(f"ACCELERATE_USE_{k}", "false").lower() == "true" for k in ("FSDP", "DEEPSPEED"))


def timeout_from_env() -> timedelta:
    raw = os.environ.get("PRORAG_DIST_TIMEOUT_S", "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"PRORAG_DIST_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"PRORAG_DIST_TIMEOUT_S={raw!r} must be positive")
    return timedelta(seconds=seconds)


def accelerator_from_env(cpu: bool | None = None):
    """An ``accelerate.Accelerator`` when this process is one of several (WORLD_SIZE > 1) or accelerate was asked
    for a sharding engine (FSDP on one GPU still shards optimizer state it can offload), else None.

    cpu: force the CPU (gloo) backend; None = accelerate's choice (CUDA when present). Mixed precision and the
    sharding strategy come from accelerate's own configuration (its config file or ACCELERATE_* variables).
    Collectives wait up to PRORAG_DIST_TIMEOUT_S (default 4 h): the other processes wait in one while the main
    one samples a stage's data through the services."""
    if world_size_from_env() <= 1 and not sharding_asked():
        return None
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(timeout=timeout_from_env())]
    return Accelerator(cpu=bool(cpu), kwargs_handlers=handlers) if cpu is not None \
        else Accelerator(kwargs_handlers=handlers)


def check_engine(accelerator) -> None:
    """Refuse, before any work, an engine the stages cannot publish from: DeepSpeed (its engine owns the model, and
    its ZeRO-3 gather needs it) and FSDP version 1 (wrapped submodules). DDP (MULTI_GPU, MULTI_CPU) and FSDP2
    are what is supported."""
    if accelerator is None:
        return
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError("the accelerate config asks for DeepSpeed, which the trainer stages do not run under; "
                         "use FSDP2 for sharding (configs/accelerate/fsdp2.yaml) or DDP (no config)")
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError("the accelerate config asks for FSDP version 1; set fsdp_version: 2 "
                         "(configs/accelerate/fsdp2.yaml)")
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.activation_checkpointing:
        # its wrappers put a "_checkpoint_wrapped_module" level into the module tree that PEFT walks to pick an
        # adapter's weights out of the gathered state dict, so a LoRA stage would publish an empty adapter (seen
        # on an H100); the stages' own setting recomputes the same activations inside the blocks
        raise ValueError("the accelerate config sets fsdp_activation_checkpointing; set it to false and set the "
                         "stage config's gradient_checkpointing to true instead")


def is_sharded(accelerator) -> bool:
    """Whether each process holds only a shard of the parameters (FSDP), so gathering them is a collective."""
    if accelerator is None:
        return False
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def finish_distributed(accelerator) -> None:
    """End a launched process's part cleanly: wait for every process, let go of what accelerate prepared and collect
    the garbage (accelerate's ``free_memory``), then destroy the process group (its ``end_training``). Why: a
    process that exits with the group alive, or with a DDP wrapper left for the interpreter's exit to destroy (a
    finished stage's training loop is garbage, but in reference cycles that only a collection frees), can abort
    in teardown ("terminate called without an active exception", SIGABRT), failing a job whose work was done:
    seen in CI, and here in 3 of 40 two-process runs shaped like a stage's end that only waited and destroyed the
    group, in none of 40 that ended this way (docs/BENCHMARKS.md, forty-sixth session). None (one process) does
    nothing."""
    if accelerator is None:
        return
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


class MainProcessFailed(RuntimeError):
    """Raised on the other processes when what the main process computed for them failed (the main process
    raises the error itself)."""


def from_main(accelerator, fn: Callable[[], Any]) -> Any:
    """``fn()`` computed by the main process alone, its result (picklable) handed to every process
    (accelerate's ``broadcast_object_list``); plain ``fn()`` without an accelerator.

    Why: data that comes through the services (the retriever, the policy's rollouts, the PRM's scores) is asked for
    once, so every process trains on identical data and the services see one client. An error in ``fn`` is raised
    on the main process and, as :class:`MainProcessFailed` naming it, on the others, instead of leaving them
    waiting for a result."""
    if accelerator is None:
        return fn()
    from accelerate.utils import broadcast_object_list

    box: list = [None]
    error: Exception | None = None
    if accelerator.is_main_process:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - told to the other processes, then raised here
            error = exc
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    broadcast_object_list(box, from_process=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise MainProcessFailed(f"the main process failed: {value}")
    return value


def sum_over_processes(accelerator, values: list[float]) -> list[float]:
    """Each value summed over the processes (statistics each process gathered on its share); as is without one."""
    if accelerator is None:
        return list(values)
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(t, reduction="sum").tolist()


def gather_lists(accelerator, mine: list) -> list[list]:
    """Every process's list (picklable items), in process order; [mine] without an accelerator."""
    if accelerator is None:
        return [mine]
    from accelerate.utils import gather_object

    # gather_object concatenates the processes' lists; one list each is wrapped so the boundaries survive
    return gather_object([mine])


def full_state_dict(accelerator, model) -> dict | None:
    """For publishing ``model`` from the main process: under FSDP its full state dict gathered from every
    process's shard (accelerate's ``get_state_dict``, a collective: every process must call this) on the main
    process; None where the model as it is on the main process is complete, so the caller saves it as usual (one
    process; DDP, whose parameters are replicated) and on the other processes."""
    if not is_sharded(accelerator):
        return None
    state = accelerator.get_state_dict(model)
    return state if accelerator.is_main_process else None


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


__all__ = ["DEFAULT_TIMEOUT_S", "MainProcessFailed", "accelerator_from_env", "check_engine", "finish_distributed",
           "from_main", "full_state_dict", "gather_lists", "is_sharded", "my_micro_batches", "sharding_asked",
           "sum_over_processes", "timeout_from_env", "world_size_from_env"]
