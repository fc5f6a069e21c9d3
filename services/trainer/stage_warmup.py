"""Stage "warmup": pre-training of the embedded base policy (copy task, reading curriculum) before any stage.

Why the embedded base needs it: prorag.data.warmup. Its data is a function of the step and it is trained by
the one loop (prorag.training.warmup), so a killed warm-up resumes from its last checkpoint, as a trainer job
or in process through prorag.training.context.local_context (how `prorag run` builds a world's base).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prorag import paths
from prorag.config import ConfigError, cfg_field
from prorag.data.loaders import iter_corpus, load_split
from prorag.data.sft import BASELINE_SYSTEM_PROMPT, template_phrases
from prorag.data.warmup import facts_from_questions
from prorag.modeling import PRESETS, WarmupConfig
from prorag.modeling import (build_model, load_policy, num_parameters, prepare_for_training, save_pretrained,
                             train_tokenizer)
from prorag.training.context import JobContext
from prorag.training.distributed import from_main, full_state_dict
from prorag.training.run_config import StageRunConfig
from prorag.training.warmup import warm_up
from prorag.trajectory import CHAT_TOKENS, SYSTEM_PROMPT, TAGS
from services.trainer.stages import register_stage


@dataclass
class WarmupStageConfig(StageRunConfig):
    """Warm up a new embedded base (or a given model) on a world's corpus and train-split facts."""

    world: str = cfg_field("default", help="embedded world whose corpus and train split are read")
    base_model: str = cfg_field("", help="Hugging Face model directory to warm up ('' = a new model of `preset` "
                                         "with a BPE tokenizer trained on the world's text)")
    preset: str = cfg_field("cpu", help="shape of the new model (prorag.modeling.PRESETS)", choices=tuple(PRESETS))
    vocab_size: int = cfg_field(8192, help="vocabulary of the new tokenizer", min=256 + len(CHAT_TOKENS) + len(TAGS))
    seed: int = cfg_field(0, help="seed for the new model's init and the warm-up's data", min=0, max=2 ** 31 - 1)
    warmup: WarmupConfig = cfg_field(help="the curriculum: phase lengths, batch size, learning rate",
                                     factory=WarmupConfig)
    output: str = cfg_field("", help="also save the warmed model in this directory, atomically ('' = only the "
                                     "run's artifact)")
    checkpoint_every: int = cfg_field(50, help="steps between checkpoints", min=1)
    grad_accum: int = cfg_field(1, help="micro-batches each step's rows are split into (a launch on several "
                                        "processes needs a multiple of their count); must divide the warm-up's "
                                        "batch_size and copy_mix", min=1, max=1024)

    def validate(self) -> None:
        super().validate()
        for name in ("batch_size", "copy_mix"):
            if getattr(self.warmup, name) % self.grad_accum:
                raise ConfigError("grad_accum", f"must divide warmup.{name} ({getattr(self.warmup, name)}), got "
                                                f"{self.grad_accum}")


def tokenizer_texts(world_dir) -> list[str]:
    """What the new tokenizer is trained on: the corpus, train and dev questions, gold sub-questions, and the
    format's fixed prompt and thought text repeated so its words become whole tokens (shorter sequences)."""
    train = load_split(world_dir, "train")
    questions = [q.question for q in train + load_split(world_dir, "dev")]
    subs = [s.question for q in train for s in q.decomposition]
    fmt = [SYSTEM_PROMPT, BASELINE_SYSTEM_PROMPT, *template_phrases()] * 50
    return [d.contents for d in iter_corpus(world_dir / "corpus.jsonl")] + questions + subs + fmt


def run_warmup(ctx: JobContext) -> dict:
    """Warm up the base policy; artifact "model" (and cfg.output when set)."""
    from transformers import AutoTokenizer  # seconds to import: only a tokenizer's training needs it

    cfg: WarmupStageConfig = ctx.config
    cfg.apply_threads()
    placement = cfg.placement()
    wdir = paths.world_dir(cfg.world)
    if cfg.base_model:
        model, tokenizer = load_policy(cfg.base_model, attn_implementation=placement.attn_implementation)
    else:
        # kept with the checkpoints, so a resumed job builds its model on the very same vocabulary
        saved = ctx.checkpoint_dir / "tokenizer"

        def trained_tokenizer():
            if saved.is_dir():
                return AutoTokenizer.from_pretrained(str(saved))
            ctx.emit(0, cfg.warmup.total_steps, message=f"training a {cfg.vocab_size}-token tokenizer on {wdir}")
            return train_tokenizer(tokenizer_texts(wdir), vocab_size=cfg.vocab_size, out_dir=saved)

        # on a launch of several processes the main one trains (or reloads) it and the others get the same one
        tokenizer = from_main(ctx.accelerator, trained_tokenizer)
        model = build_model(cfg.preset, tokenizer, seed=cfg.seed)
    model = prepare_for_training(model, placement, gradient_checkpointing=cfg.gradient_checkpointing)
    docs = {d.id: d.contents for d in iter_corpus(wdir / "corpus.jsonl")}
    facts = facts_from_questions(load_split(wdir, "train"))
    result = warm_up(ctx, model, tokenizer, docs, facts, cfg.warmup, seed=cfg.seed,
                     checkpoint_every=cfg.checkpoint_every, log_every=cfg.log_every, placement=placement,
                     compile=cfg.compile, grad_accum=cfg.grad_accum)
    if not result.completed:
        return {}
    weights = full_state_dict(ctx.accelerator, model)  # every process of a launch takes part in the gather
    if not ctx.is_main:  # the other processes of a launch publish nothing
        return {}
    ctx.write_artifact("model", save_pretrained(model, tokenizer, ctx.run_dir / "model", state_dict=weights))
    if cfg.output:
        save_pretrained(model, tokenizer, cfg.output, state_dict=weights)
    return {"final_loss": result.loss, "steps": result.step, "num_parameters": num_parameters(model)}


register_stage("warmup", WarmupStageConfig, run_warmup,
               description="pre-training of the embedded base policy: copy task, then the reading curriculum")
