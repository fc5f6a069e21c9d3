"""How much GPU memory a training job needs, estimated from its model's shape and its settings before it starts.

What one process holds while it trains (the trainer's in-process stages, prorag.training.loop):

* full-parameter training keeps the weights it updates in float32, their gradients in float32 and AdamW's two
  moments in float32: 16 bytes a parameter, and under mixed precision autocast's cached low-precision copies of the
  weights (2 bytes a parameter in bfloat16);
* LoRA stores the frozen base in the compute dtype (2 bytes a parameter in bfloat16) and trains only the adapters
  (16 bytes an adapter parameter, as above);
* activations of one micro-batch (its sequences x ``max_len`` tokens, the longest it may hold): per token and decoder
  layer the tensors the backward pass reads (the norms' inputs, q / k / v and the attention output, the MLP's gate,
  up and product: ``7 h + 2 kv + 4 I`` values in the compute dtype, with SDPA / flash attention, which keep no
  seq x seq matrix); with gradient checkpointing only each layer's input is kept (``h`` values) plus one layer's
  working set while it is recomputed;
* the logits of the micro-batch: ``tokens x vocab`` in the compute dtype, and in float32 for the loss and its
  gradient (4 + 4 bytes): at a 152k vocabulary this is often the largest single term.

An estimate, meant to refuse what cannot fit (an 8B full fine-tune on one GPU needs ~131 GB before activations), not to
promise that what passes fits: the allocator's fragmentation, the CUDA context and the kernels' workspaces come on top
(:data:`HEADROOM` of the device is what a job may plan for).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
#: the share of a device's memory a job's estimate may take (the rest: CUDA context, allocator, workspaces)
HEADROOM = 0.9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Qwen / Llama layout: GQA attention, a gated MLP)."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        cfg = cfg.get("text_config", cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(hidden=hidden, layers=int(cfg["num_hidden_layers"]), intermediate=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelShape":
        """From a Hugging Face model directory's config.json (KeyError / OSError when it has none that says)."""
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def params(self) -> int:
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden + 2 * self.head_dim
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def lora_params(self, r: int, targets: str | tuple[str, ...]) -> int:
        names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
        shapes = self.linear_shapes()
        return self.layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names if n in shapes)


@dataclass(frozen=True)
class TrainingJob:
    """What decides a training process's memory: the model, LoRA or not, the precision, one micro-batch's size."""

    shape: ModelShape
    micro_sequences: int
    seq_len: int
    dtype: str = "bfloat16"  # the compute dtype (trained weights and optimizer state are float32 regardless)
    gradient_checkpointing: bool = False
    lora_r: int = 0  # 0 = full-parameter
    lora_targets: str = ",".join(LINEARS)
    max_tokens: int = 0  # a cap on one micro-batch's tokens (0 = micro_sequences x seq_len)
    extra_params: int = 0  # trained parameters beside the model's (a PRM's head)

    @property
    def tokens(self) -> int:
        tokens = self.micro_sequences * self.seq_len
        return min(tokens, self.max_tokens) if self.max_tokens else tokens

    def estimate(self) -> "Estimate":
        s, cb = self.shape, DTYPE_BYTES[self.dtype]
        mixed = self.dtype != "float32"
        params = s.params + self.extra_params
        if self.lora_r:
            trained = s.lora_params(self.lora_r, self.lora_targets) + self.extra_params
            weights = s.params * cb + trained * 4
        else:
            trained = params
            weights = params * 4 + (params * cb if mixed else 0)  # float32 masters + autocast's copies
        per_token_layer = cb * (7 * s.hidden + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate)
        if self.gradient_checkpointing:
            activations = self.tokens * (s.layers * s.hidden * cb + per_token_layer)
        else:
            activations = self.tokens * s.layers * per_token_layer
        parts = {"weights": weights, "gradients": trained * 4, "optimizer": trained * 8,
                 "activations": activations, "logits": self.tokens * s.vocab * (cb + 8)}
        return Estimate(params=params, trained=trained, parts=parts, job=self)


@dataclass(frozen=True)
class Estimate:
    params: int
    trained: int
    parts: dict[str, int] = field(default_factory=dict)
    job: TrainingJob | None = None

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def states(self) -> int:
        """What FSDP shards over the processes: weights, gradients and optimizer state."""
        return self.parts["weights"] + self.parts["gradients"] + self.parts["optimizer"]

    def fits(self, device_bytes: float) -> bool:
        return self.total <= HEADROOM * device_bytes

    def sharded(self, device_bytes: float, *, most: int = 64) -> tuple[int, int] | None:
        """(GPUs, sequences per micro-batch): the fewest GPUs of ``device_bytes`` (a power of two: the count must
        divide the configs' grad_accum) over which FSDP2 fits this job, each process holding its share of the states,
        one layer gathered whole and its own micro-batch's activations and logits, and the most sequences of
        ``seq_len`` a micro-batch may then hold (at most this job's); None when not even ``most`` GPUs do."""
        if self.job is None or not self.job.tokens:
            return None
        per_sequence = (self.parts["activations"] + self.parts["logits"]) / self.job.tokens * self.job.seq_len
        layer = self.states / max(1, self.job.shape.layers)
        n = 1
        while n <= most:
            room = HEADROOM * device_bytes - self.states / n - layer
            if room >= per_sequence:
                return n, min(self.job.micro_sequences, int(room // per_sequence))
            n *= 2
        return None

    def describe(self) -> str:
        j = self.job
        kind = (f"LoRA r={j.lora_r} ({self.trained / 1e6:,.1f}M trained parameters)" if j and j.lora_r
                else "full-parameter (float32 weights, gradients and AdamW state)")
        parts = ", ".join(f"{k} {v / GB:,.1f}" for k, v in self.parts.items())
        batch = (f"micro-batch {j.micro_sequences} x {j.seq_len} tokens"
                 + (f" (at most {j.max_tokens:,} tokens)" if j.max_tokens else "")
                 + (", gradient checkpointing" if j.gradient_checkpointing else ", no gradient checkpointing")
                 + f", {j.dtype} compute") if j else ""
        return (f"~{self.total / GB:,.1f} GB ({parts} GB) for {self.params / 1e9:,.2f}B parameters, {kind}, {batch}")


def gpus_text(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


def ceil_gb(nbytes: float) -> int:
    return math.ceil(nbytes / GB)


__all__ = ["DTYPE_BYTES", "Estimate", "GB", "HEADROOM", "LINEARS", "ModelShape", "TrainingJob", "ceil_gb", "gpus_text"]
