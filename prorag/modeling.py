"""The embedded policy: a byte-level BPE tokenizer and a small randomly initialised Qwen3.

The same loading code serves any Hugging Face causal LM directory, so a Qwen3-8B checkpoint on
a GPU host goes through :func:`load_policy` exactly like the CPU test model.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from prorag.config import cfg_field, from_dict
from prorag.errors import InvalidArgument, NotFound
from prorag.io import atomic_dir, sha256_file
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
            raise InvalidArgument(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.init == "induction":  # refused with the config, not later as a bare ValueError from the wiring
            from prorag.init_circuits import induction_shape_problem

            problem = induction_shape_problem(self.num_layers, self.head_dim, self.hidden_size)
            if problem:
                raise InvalidArgument(problem)


#: "tiny": ~0.6M params with an 8k vocabulary (~0.2M at 2k), for tests. "small" (the defaults): 8.0M params with an
#: 8k vocabulary; on 2 AVX2 cores (fp32, static KV cache) it decoded ~1,450-2,150 tokens/s at batch 64.
PRESETS: dict[str, PolicyModelConfig] = {
    "tiny": PolicyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
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
        from prorag.init_circuits import wire_induction_circuit

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


def save_pretrained(model, tokenizer, out_dir: str | Path) -> Path:
    """Write model (safetensors) and tokenizer under ``out_dir``; readers never see a partial directory."""
    _quiet()
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
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


def load_policy(path: str | Path, device: str = "cpu", dtype="float32"):
    """Load any Hugging Face causal LM directory (or hub id) and its tokenizer; returns (model, tokenizer).

    The model is in eval mode on ``device``; the tokenizer gets a pad token (eos when it has none)
    and the format tags as special tokens (embeddings resized if they were missing).
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
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_dtype(dtype))
    add_format_tokens(tokenizer, model)
    return model.to(device).eval(), tokenizer


def model_sha256(path: str | Path) -> str:
    """Identity of a model directory: sha256 over the names and hashes of its safetensors files."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise NotFound(f"no .safetensors files under {path}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


@dataclass
class WarmupConfig:
    """Pre-training of the embedded base before any stage (see prorag.warmup_data for why)."""

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
    lr: float = cfg_field(3e-3, help="AdamW learning rate (constant after the ramp)", min=0.0, max=1.0)
    lr_warmup_steps: int = cfg_field(0, help="steps of linear learning-rate ramp; Adam's first full-size "
                                              "steps disturbed the wired induction circuit (measured)", min=0)

    @property
    def total_steps(self) -> int:
        return (self.copy_steps + 3 * self.sentence_steps + self.document_steps + self.gap_steps
                + self.paraphrase_steps + self.retrieved_steps)


def warm_up_base(model, tokenizer, docs: dict[str, str], facts, cfg: WarmupConfig | None = None, seed: int = 0,
                 progress=None) -> list[float]:
    """Copy task, then the reading curriculum, on ``model`` in place; returns the loss per step.

    docs: doc id -> text; facts: prorag.warmup_data.Fact list (their documents must be in docs).
    progress(done, total) is called every step.
    """
    from prorag.algorithms.losses import weighted_lm_loss
    from prorag.data.loaders import parse_contents
    from prorag.warmup_data import (answer_pools, copy_batch, counterfactual_swap, facts_by_doc, paraphrase_example,
                                    paraphrase_groups, reading_example, retrieved_reading_example)

    cfg = cfg or WarmupConfig()
    rng = random.Random(seed)
    by_doc = facts_by_doc(facts, docs)
    doc_ids = sorted(by_doc)
    if not doc_ids and cfg.sentence_steps + cfg.document_steps + cfg.retrieved_steps:
        raise InvalidArgument("no facts whose document is in the corpus: nothing to read")
    # distractors ask about the same relation where possible ("Who founded ..."), as retrieval's do
    by_relation: dict[str, list[str]] = {}
    for did in doc_ids:
        by_relation.setdefault(" ".join(by_doc[did][0].question.split()[:2]), []).append(did)

    def distractors_for(did):
        pool = by_relation[" ".join(by_doc[did][0].question.split()[:2])]
        others = [d for d in (pool if len(pool) > cfg.distractors else doc_ids) if d != did]
        return rng.sample(others, min(cfg.distractors, len(others)))
    pad = tokenizer.pad_token_id
    low, high = len(TAGS) + len(CHAT_TOKENS) + 256, len(tokenizer)  # ordinary merged tokens only
    pools = answer_pools(facts, docs) if cfg.counterfactual else {}
    phrasings = paraphrase_groups([f for fs in by_doc.values() for f in fs]) if cfg.paraphrase_steps else []
    if cfg.paraphrase_steps and not phrasings:
        raise InvalidArgument("paraphrase_steps > 0 but no fact is asked more than one way: nothing to paraphrase")

    def gap_text():
        # random ordinary tokens: no fact in them, so the answer can only come from the passage
        ids = [rng.randrange(low, high) for _ in range(rng.randint(1, cfg.gap_tokens))]
        return tokenizer.decode(ids).replace("\n", " ").strip() + "\n"

    def encode(segs):
        ids, trained = [], []
        for text, is_answer in segs:
            t = tokenizer.encode(text, add_special_tokens=False)
            ids += t
            trained += [is_answer] * len(t)
        return ids, trained

    def reading_batch(n_sentences):
        rows = []
        while len(rows) < cfg.batch_size:
            if n_sentences == "paraphrase" and rng.random() < cfg.paraphrase_share:
                rows.append(encode(paraphrase_example(rng, phrasings[rng.randrange(len(phrasings))])))
                continue
            did = doc_ids[rng.randrange(len(doc_ids))]
            text, doc_facts = docs[did], by_doc[did]
            if cfg.counterfactual and rng.random() < cfg.counterfactual:
                text, doc_facts = counterfactual_swap(rng, text, doc_facts, parse_contents(text)[0], pools)
            if n_sentences == "retrieved":
                others = distractors_for(did)
                segs = retrieved_reading_example(rng, did, {did: text, **{d: docs[d] for d in others}}, doc_facts,
                                                 others, chat=rng.random() < cfg.chat_share)
            elif n_sentences in ("gap", "paraphrase"):
                first = rng.random() < cfg.question_first
                segs = reading_example(rng, text, doc_facts, None, question_first=first,
                                       gap=gap_text() if rng.random() < cfg.gap_share else "")
            else:
                segs = reading_example(rng, text, doc_facts, n_sentences)
            if segs is not None:
                rows.append(encode(segs))
        T = max(len(r[0]) for r in rows)
        x = torch.full((len(rows), T), pad, dtype=torch.long)
        m = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, (ids, trained) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
            m[i, :len(ids)] = torch.tensor(trained)
        return x, m

    def copy_rows(n):
        # a length drawn per batch: with one fixed length the repeat is solved by attending a fixed
        # distance back (measured), not by the content-based copying the agent needs
        lo = min(cfg.copy_min_length, cfg.copy_length)
        length = cfg.copy_length if lo == cfg.copy_length else rng.randint(lo, cfg.copy_length)
        x = torch.tensor(copy_batch(rng, n, length, low, high))
        m = torch.zeros_like(x, dtype=torch.bool)
        m[:, length + 1:] = True  # the repeat's first token is not predictable
        return x, m

    def loss_on(x, m):
        return weighted_lm_loss(model, x, torch.ones_like(x), x.masked_fill(~m, -100), m.float())[0]

    phases = [("copy", cfg.copy_steps), *[(k, cfg.sentence_steps) for k in (1, 2, 3)], (None, cfg.document_steps),
              ("gap", cfg.gap_steps), ("paraphrase", cfg.paraphrase_steps),
              ("retrieved", cfg.retrieved_steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, cfg.lr_warmup_steps)))
    model.train()
    losses: list[float] = []
    try:
        for phase, steps in phases:
            for _ in range(steps):
                if phase == "copy":
                    loss = loss_on(*copy_rows(cfg.batch_size))
                else:
                    loss = loss_on(*reading_batch(phase))
                    if cfg.copy_mix:  # measured: the reading phases alone erased the copy skill
                        loss = loss + loss_on(*copy_rows(cfg.copy_mix))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                ramp.step()
                losses.append(float(loss.detach()))
                if progress:
                    progress(len(losses), cfg.total_steps)
    finally:
        model.eval()
    return losses


def describe_model(model) -> dict:
    """Small JSON-able summary for ModelInfo."""
    c = model.config
    return {"architecture": type(model).__name__, "num_parameters": num_parameters(model),
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers,
            "max_position_embeddings": c.max_position_embeddings, "dtype": str(next(model.parameters()).dtype)}


__all__ = ["CHAT_TEMPLATE", "PolicyModelConfig", "PRESETS", "train_tokenizer", "add_format_tokens", "model_config",
           "build_model", "num_parameters", "save_pretrained", "load_policy", "model_sha256",
           "WarmupConfig", "warm_up_base", "describe_model"]
