"""Where and in what precision a stage or a service computes: one config, resolved once, checked before any work.

Every trainer stage and the PRM service take the same four settings (their configs inherit :class:`DeviceConfig`
or :class:`ComputeConfig`), resolved here into a :class:`Placement`:

* ``device``: auto = the first CUDA device when torch sees one, else the CPU; or ``cpu``, ``cuda``, ``cuda:N``;
* ``dtype``: the compute precision. auto = bfloat16 on a GPU that supports it, float32 elsewhere. Training keeps
  the weights it updates (and so the optimizer's state) in float32 and computes the forward and backward passes
  under ``torch.autocast`` in this dtype (mixed precision); a frozen base under LoRA is stored in it. Serving
  stores the weights in it;
* ``attn_implementation``: auto = flash_attention_2 when the flash-attn package is installed (and the device is a
  GPU), else PyTorch's SDPA;
* ``gradient_checkpointing`` (training only): recompute activations in the backward pass instead of storing them.

The same code runs on the CPU (bf16 autocast works there too), so tests exercise the path a GPU takes with the
device and dtype as parameters. A setting the machine cannot honour (cuda without a GPU, flash_attention_2
without flash-attn, bf16 on a GPU without it) is refused by :func:`check_device_config` when the config is
built, i.e. at job submission or service start, never part-way through a job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from prorag.config import cfg_field
from prorag.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from prorag.training.lm import fused_linear_ce_sum

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: float16 needs a loss scaler to train; bfloat16 does not, and every GPU this project targets has it
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DeviceConfig:
    """Where a model runs and in what precision (a service, or the device half of a training config)."""

    device: str = cfg_field("auto", help="auto (the first GPU when torch sees one, else cpu), cpu, cuda or cuda:N")
    dtype: str = cfg_field("auto", help="compute dtype: auto (bfloat16 on a GPU that has it, else float32), "
                                        "float32, bfloat16, float16 (serving only)", choices=DTYPES)
    attn_implementation: str = cfg_field("auto", help="attention kernel: auto (flash_attention_2 when flash-attn "
                                                      "is installed and the device is a GPU, else sdpa), sdpa, "
                                                      "eager, flash_attention_2", choices=ATTN_IMPLEMENTATIONS)

    def validate(self) -> None:
        check_device_config(self)


@dataclass
class ComputeConfig(DeviceConfig):
    """DeviceConfig plus what only training uses."""

    dtype: str = cfg_field("auto", help="compute dtype under autocast: auto (bfloat16 on a GPU that has it, else "
                                        "float32), float32, bfloat16; trained weights and optimizer state stay "
                                        "float32", choices=TRAIN_DTYPES)
    gradient_checkpointing: bool = cfg_field(False, help="recompute activations in the backward pass (less memory, "
                                                         "~1/3 more compute)")
    compile: bool = cfg_field(False, help="torch.compile the model's forward (GPU: measured ~2x tokens/s at a "
                                          "0.6B shape, docs/BENCHMARKS.md; the first steps pay the compile)")
    fused_linear_ce: bool = cfg_field(False, help="CUDA: the LM head and the cross-entropy fused in chunks "
                                                  "(liger-kernel), so the [tokens, vocab] logits are never held at "
                                                  "once; refused on a CPU or without liger-kernel")


@dataclass(frozen=True)
class Placement:
    """A resolved DeviceConfig: concrete device, compute dtype and attention kernel."""

    device: torch.device
    dtype: torch.dtype
    attn_implementation: str
    fused_linear_ce: bool = False  # a training placement's LM-head loss through liger-kernel's fused kernel

    @property
    def mixed(self) -> bool:
        """Whether compute runs under autocast in a lower precision than the float32 weights."""
        return self.dtype != torch.float32

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def autocast(self):
        """The context a training forward pass runs in: autocast to ``dtype``, or nothing for float32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def describe(self) -> dict:
        return {"device": str(self.device), "dtype": self.dtype_name, "attn_implementation": self.attn_implementation,
                "fused_linear_ce": self.fused_linear_ce}

    def sum_ce(self):
        """The fused head-and-cross-entropy kernel prorag.training.lm.weighted_lm_loss takes when this placement
        asks for one; None = the plain head, then the cross-entropy."""
        return fused_linear_ce_sum() if self.fused_linear_ce else None


CPU_FP32 = Placement(torch.device("cpu"), torch.float32, "sdpa")


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_device(spec: str) -> torch.device:
    """auto / cpu / cuda / cuda:N -> a torch.device; FailedPrecondition when the GPU asked for is not there."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise InvalidArgument(f"device {spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidArgument(f"device {spec!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise FailedPrecondition(f"device {spec!r} asked for, but torch sees no CUDA device here (torch "
                                 f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device=auto "
                                 "or cpu, or run on a GPU host")
    index = dev.index if dev.index is not None else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise FailedPrecondition(f"device {spec!r} asked for, but only {count} CUDA device(s) are visible "
                                 "(CUDA_VISIBLE_DEVICES / the container's device_ids decide which)")
    return torch.device("cuda", index)


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return True  # emulated or native (AVX512-BF16 / AMX): correct either way, the CPU default stays float32
    return bool(torch.cuda.is_bf16_supported()) if device.type == "cuda" else False


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_supported(device) else torch.float32
    if spec not in _TORCH_DTYPES:
        raise InvalidArgument(f"dtype {spec!r}: use one of {', '.join(DTYPES)}")
    dtype = _TORCH_DTYPES[spec]
    if dtype == torch.bfloat16 and not bf16_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise FailedPrecondition(f"dtype bfloat16 asked for, but {name} does not support it (compute capability "
                                 "< 8.0); use dtype=float16 for serving or float32")
    return dtype


def resolve_attn(spec: str, device: torch.device) -> str:
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "flash_attention_2" if device.type == "cuda" and flash_attn_installed() else "sdpa"
    if spec == "flash_attention_2":
        if not flash_attn_installed():
            raise FailedPrecondition("attn_implementation flash_attention_2 asked for, but the flash-attn package is "
                                     "not installed (pip install 'prorag[gpu]' on a CUDA host); use auto or sdpa")
        if device.type != "cuda":
            raise FailedPrecondition("attn_implementation flash_attention_2 runs on CUDA devices only; this job's "
                                     f"device is {device}; use auto or sdpa")
    elif spec not in ATTN_IMPLEMENTATIONS:
        raise InvalidArgument(f"attn_implementation {spec!r}: use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    return spec


def resolve(cfg: Any) -> Placement:
    """The Placement of any config carrying device / dtype / attn_implementation (missing ones are auto)."""
    device = resolve_device(getattr(cfg, "device", "auto"))
    dtype = resolve_dtype(getattr(cfg, "dtype", "auto"), device)
    if dtype == torch.float16 and isinstance(cfg, ComputeConfig):
        raise InvalidArgument("dtype float16 cannot train without a loss scaler; use bfloat16 or float32")
    fused = bool(getattr(cfg, "fused_linear_ce", False))
    if fused and device.type != "cuda":
        raise FailedPrecondition(f"fused_linear_ce runs on CUDA devices only (liger-kernel's Triton kernel); this "
                                 f"job's device is {device}; set fused_linear_ce=false")
    if fused and importlib.util.find_spec("liger_kernel") is None:
        raise FailedPrecondition("fused_linear_ce asked for, but the liger-kernel package is not installed (pip "
                                 "install liger-kernel on a CUDA host); set fused_linear_ce=false")
    return Placement(device, dtype, resolve_attn(getattr(cfg, "attn_implementation", "auto"), device), fused)


def check_device_config(cfg: Any) -> None:
    """Refuse, before anything runs, a device / dtype / attention setting this machine cannot honour."""
    resolve(cfg)


def device_fields(cfg: Any) -> dict:
    """The DeviceConfig / ComputeConfig fields of ``cfg`` (for passing one stage's settings to another helper)."""
    names = {f.name for f in dataclasses.fields(ComputeConfig)}
    return {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, dicts) on ``device``; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True) if batch.device != device else batch
    if isinstance(batch, tuple):
        return tuple(to_device(x, device) for x in batch)
    if isinstance(batch, list):
        return [to_device(x, device) for x in batch]
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def batch_shape(batch: Any) -> str:
    """A short description of a micro-batch's size for error messages: the first tensor's shape, else its length."""
    if isinstance(batch, torch.Tensor):
        return "x".join(str(d) for d in batch.shape)
    if isinstance(batch, (tuple, list)):
        for x in batch:
            if isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and x):
                return batch_shape(x)
        return f"{len(batch)} items"
    return type(batch).__name__


def out_of_memory(exc: BaseException, where: str, advice: str) -> ResourceExhausted:
    """A GPU out-of-memory error as ResourceExhausted with where it happened and what to change; the allocator's
    cached blocks are released so the process can go on (a service keeps serving)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ResourceExhausted(f"out of memory on the GPU {where}: {first}; {advice}")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


__all__ = ["ATTN_IMPLEMENTATIONS", "CPU_FP32", "ComputeConfig", "DTYPES", "DeviceConfig", "Placement", "TRAIN_DTYPES",
           "batch_shape", "bf16_supported", "check_device_config", "device_fields", "flash_attn_installed",
           "is_out_of_memory", "out_of_memory", "resolve", "resolve_attn", "resolve_device", "resolve_dtype",
           "to_device"]
