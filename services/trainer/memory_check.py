"""Before a training job is queued: its memory (prorag.training.memory) against the GPU it would run on in this
trainer. A job that cannot fit is refused with FAILED_PRECONDITION naming the estimate and the launch that would fit
(the multi-GPU launch of docs/TRAINING.md, or a smaller micro-batch), instead of running out of memory an hour in.

The trainer's in-process stages run on one device (the job's ``device``); a job on the CPU is not checked (host
memory is the container's limit, and the CPU stages train small models). A stage not listed in :data:`STAGES`, or a
model whose config.json does not say its shape, is not checked either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.training.memory import GB, HEADROOM, ModelShape, TrainingJob, ceil_gb, gpus_text

log = logging.getLogger("prorag.trainer.memory")


@dataclass(frozen=True)
class StageMemory:
    """Where a stage's config says what its training process holds."""

    model_field: str
    micro_sequences: Callable[[Any], int]  # sequences in one micro-batch
    lora: bool = False
    max_tokens: Callable[[Any], int] | None = None  # a cap on one micro-batch's tokens
    head_params: Callable[[ModelShape], int] | None = None  # trained parameters beside the model's


def _per_step(cfg) -> int:
    return max(1, cfg.batch_size // max(1, cfg.grad_accum))


#: the gradient stages that train a model of the size of their base (warmup builds its own small model)
STAGES: dict[str, StageMemory] = {
    "sft": StageMemory("base_model", _per_step),
    "rft": StageMemory("base_model", _per_step),
    # a PRM scores both siblings of each pair: two sequences a pair, and a scalar head on the trunk
    "prm": StageMemory("policy_model", lambda c: 2 * _per_step(c), head_params=lambda s: s.hidden + 1),
    # DPO: the chosen and the rejected continuation of each pair
    "dpo": StageMemory("base_model", lambda c: 2 * _per_step(c), lora=True),
    # RL's update: micro-batches of at most chunk_tokens padded tokens
    "rl": StageMemory("base_model", lambda c: max(1, c.chunk_tokens // c.max_len), lora=True,
                      max_tokens=lambda c: c.chunk_tokens),
}


def device_memory(placement) -> tuple[str, int] | None:
    """(the device's name, its memory in bytes) when the job runs on a GPU; None on the CPU."""
    if placement.device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(placement.device)
    return f"{placement.device} ({props.name})", int(props.total_memory)


def training_job(stage_name: str, cfg) -> TrainingJob | None:
    """The job's memory model, or None when this stage or its model cannot be estimated."""
    spec = STAGES.get(stage_name)
    if spec is None:
        return None
    from services.trainer.stages import resolve_model

    try:
        path = resolve_model(getattr(cfg, "world", "default"), getattr(cfg, spec.model_field), spec.model_field)
        shape = ModelShape.from_dir(path)
    except (InvalidArgument, OSError, KeyError, TypeError, ValueError) as e:
        log.info("no memory estimate for this %s job: %s", stage_name, e)
        return None
    placement = cfg.placement()
    return TrainingJob(shape=shape, micro_sequences=spec.micro_sequences(cfg), seq_len=cfg.max_len,
                       dtype=placement.dtype_name, gradient_checkpointing=bool(cfg.gradient_checkpointing),
                       lora_r=int(getattr(cfg, "lora_r", 0)) if spec.lora else 0,
                       lora_targets=getattr(cfg, "lora_targets", TrainingJob.lora_targets),
                       max_tokens=spec.max_tokens(cfg) if spec.max_tokens else 0,
                       extra_params=spec.head_params(shape) if spec.head_params else 0)


def check_fits(stage_name: str, cfg, *, device=None) -> None:
    """FailedPrecondition when the job's estimate exceeds what its GPU can give it."""
    if stage_name not in STAGES:
        return
    found = (device or device_memory)(cfg.placement())
    if found is None:  # a CPU job
        return
    job = training_job(stage_name, cfg)
    if job is None:
        return
    name, total = found
    est = job.estimate()
    if est.fits(total):
        return
    fixes = []
    sharded = est.sharded(total)
    if sharded and not job.lora_r:
        n, seqs = sharded
        micro = (f"micro-batches of at most {seqs} sequence(s) of {job.seq_len} tokens (batch_size / grad_accum, "
                 f"grad_accum a multiple of {n})") if seqs < job.micro_sequences else "this micro-batch"
        fixes.append(f"the multi-GPU launch (FSDP2) over {gpus_text(n)} like this one with {micro}: on one host "
                     f"`docker compose -f compose.yaml -f compose.train.yaml --profile gpu run --rm trainer-launch "
                     f"{stage_name} /configs/<config>.json <run>` with LAUNCH_GPUS naming {gpus_text(n)}; on a cluster "
                     f"k8s/training with NODES x GPUS_PER_NODE = {n} (docs/TRAINING.md)")
    elif sharded:
        fixes.append(f"micro-batches of at most {sharded[1]} sequence(s) of {job.seq_len} tokens"
                     if sharded[0] == 1 else f"the multi-GPU launch over {gpus_text(sharded[0])} (docs/TRAINING.md)")
    if not job.gradient_checkpointing:
        fixes.append("gradient_checkpointing=true")
    if not job.lora_r and stage_name in ("sft", "rft"):
        fixes.append("a LoRA stage instead (rl, dpo) on this GPU")
    raise FailedPrecondition(
        f"this {stage_name} job needs {est.describe()}; {name} has {total / GB:,.1f} GB, of which a job may plan for "
        f"{ceil_gb(total * HEADROOM)} GB. It would fit with "
        + ("; or ".join(fixes) if fixes else "a larger GPU") + ".")


__all__ = ["STAGES", "StageMemory", "check_fits", "device_memory", "training_job"]
