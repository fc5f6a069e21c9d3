"""The embedded base's warm-up as data and loss for the one training loop (why it exists: prorag.data.warmup).

Phases, in order (prorag.modeling.WarmupConfig sets their lengths): copy task; reading with 1, 2, then 3 sentences;
whole documents; gap rows; paraphrase rows mixed with gap rows; reading among retrieved documents; the copy task again
(restores what the reading phases wore down). Each step's rows are drawn from a generator seeded with (seed, step)
alone, so a resumed warm-up trains on exactly the batches an uninterrupted one does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prorag.data.loaders import parse_contents
from prorag.errors import InvalidArgument
from prorag.modeling import WarmupConfig
from prorag.training.context import JobContext
from prorag.training.lm import weighted_lm_loss
from prorag.training.loop import LoopConfig, LoopResult, run_loop
from prorag.trajectory import CHAT_TOKENS, TAGS
from prorag.data.warmup import (Fact, answer_pools, copy_batch, counterfactual_swap, facts_by_doc, paraphrase_example,
                                paraphrase_groups, reading_example, retrieved_reading_example)


@dataclass
class WarmupBatch:
    """One step's rows as parts whose losses add up: (ids [B,T], trained [B,T] bool) each (the reading
    rows, then the copy rows of copy_mix), and the real (unpadded) tokens in them."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    tokens: int


def phases(cfg: WarmupConfig) -> list[tuple[str | int | None, int]]:
    """(phase, steps) in training order; phase: "copy", a sentence count, None (whole documents), "gap",
    "paraphrase" or "retrieved"."""
    return [("copy", cfg.copy_steps), *[(k, cfg.sentence_steps) for k in (1, 2, 3)], (None, cfg.document_steps),
            ("gap", cfg.gap_steps), ("paraphrase", cfg.paraphrase_steps), ("retrieved", cfg.retrieved_steps),
            ("copy", cfg.copy_final_steps)]


class WarmupBatches:
    """``batches(step) -> WarmupBatch``: the warm-up's data as a function of the step.

    docs: doc id -> text (wiki-18 ``contents``); facts: prorag.data.warmup.Fact list (their documents must
    be in docs).
    """

    def __init__(self, tokenizer, docs: Mapping[str, str], facts: Sequence[Fact], cfg: WarmupConfig, seed: int = 0):
        self.tokenizer, self.docs, self.cfg, self.seed = tokenizer, docs, cfg, seed
        self.by_doc = facts_by_doc(facts, docs)
        self.doc_ids = sorted(self.by_doc)
        if not self.doc_ids and (cfg.sentence_steps + cfg.document_steps + cfg.gap_steps + cfg.paraphrase_steps
                                 + cfg.retrieved_steps):
            raise InvalidArgument("no facts whose document is in the corpus: nothing to read")
        # distractors ask about the same relation where possible ("Who founded ..."), as retrieval's do
        self.by_relation: dict[str, list[str]] = {}
        for did in self.doc_ids:
            self.by_relation.setdefault(self._relation(did), []).append(did)
        self.low, self.high = len(TAGS) + len(CHAT_TOKENS) + 256, len(tokenizer)  # ordinary merged tokens only
        self.pools = answer_pools(facts, docs) if cfg.counterfactual else {}
        self.phrasings = (paraphrase_groups([f for fs in self.by_doc.values() for f in fs])
                          if cfg.paraphrase_steps else [])
        if cfg.paraphrase_steps and not self.phrasings:
            raise InvalidArgument("paraphrase_steps > 0 but no fact is asked more than one way: nothing to paraphrase")
        self.schedule = phases(cfg)
        self._last: tuple[int, WarmupBatch] | None = None

    def _relation(self, did: str) -> str:
        return " ".join(self.by_doc[did][0].question.split()[:2])

    def phase_at(self, step: int) -> str | int | None:
        for phase, steps in self.schedule:
            if step < steps:
                return phase
            step -= steps
        raise IndexError(f"step beyond the warm-up's {self.cfg.total_steps} steps")

    def __call__(self, step: int) -> WarmupBatch:
        rng = random.Random(self.seed * 1_000_003 + step)
        phase = self.phase_at(step)
        if phase == "copy":
            parts = [self._copy_rows(rng, self.cfg.batch_size)]
        else:
            parts = [self._reading_rows(rng, phase)]
            if self.cfg.copy_mix:  # measured: the reading phases alone erased the copy skill
                parts.append(self._copy_rows(rng, self.cfg.copy_mix))
        return WarmupBatch([(x, m) for x, m, _ in parts], sum(n for _, _, n in parts))

    def micro_batch(self, i: int, grad_accum: int) -> WarmupBatch:
        """Micro-batch i of ``grad_accum`` per step: share i mod grad_accum of step i // grad_accum's rows (each
        part's rows split evenly), so a launch on several processes can split a step; grad_accum=1 is the step's
        batch itself."""
        step, j = divmod(i, grad_accum)
        if self._last is None or self._last[0] != step:
            self._last = (step, self(step))  # the step's rows are drawn once, whichever share is asked first
        batch = self._last[1]
        if grad_accum == 1:
            return batch
        parts = []
        for x, m in batch.parts:
            if x.shape[0] % grad_accum:
                raise InvalidArgument(f"warm-up step {step}: {x.shape[0]} rows do not split into grad_accum="
                                      f"{grad_accum} equal micro-batches; make batch_size and copy_mix multiples "
                                      "of it")
            n = x.shape[0] // grad_accum
            parts.append((x[j * n:(j + 1) * n], m[j * n:(j + 1) * n]))
        pad = self.tokenizer.pad_token_id
        return WarmupBatch(parts, sum(int((x != pad).sum()) for x, _ in parts))

    # -- rows
    def _copy_rows(self, rng: random.Random, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        # a length drawn per batch: with one fixed length the repeat is solved by attending a fixed
        # distance back (measured), not by the content-based copying the agent needs
        cfg = self.cfg
        lo = min(cfg.copy_min_length, cfg.copy_length)
        length = cfg.copy_length if lo == cfg.copy_length else rng.randint(lo, cfg.copy_length)
        x = torch.tensor(copy_batch(rng, n, length, self.low, self.high))
        m = torch.zeros_like(x, dtype=torch.bool)
        m[:, length + 1:] = True  # the repeat's first token is not predictable
        return x, m, x.numel()

    def _gap_text(self, rng: random.Random) -> str:
        # random ordinary tokens: no fact in them, so the answer can only come from the passage
        ids = [rng.randrange(self.low, self.high) for _ in range(rng.randint(1, self.cfg.gap_tokens))]
        return self.tokenizer.decode(ids).replace("\n", " ").strip() + "\n"

    def _encode(self, segs):
        ids, trained = [], []
        for text, is_answer in segs:
            t = self.tokenizer.encode(text, add_special_tokens=False)
            ids += t
            trained += [is_answer] * len(t)
        return ids, trained

    def _distractors(self, rng: random.Random, did: str) -> list[str]:
        pool = self.by_relation[self._relation(did)]
        others = [d for d in (pool if len(pool) > self.cfg.distractors else self.doc_ids) if d != did]
        return rng.sample(others, min(self.cfg.distractors, len(others)))

    def _reading_rows(self, rng: random.Random, phase) -> tuple[torch.Tensor, torch.Tensor, int]:
        cfg, docs = self.cfg, self.docs
        rows = []
        while len(rows) < cfg.batch_size:
            if phase == "paraphrase" and rng.random() < cfg.paraphrase_share:
                rows.append(self._encode(paraphrase_example(rng, self.phrasings[rng.randrange(len(self.phrasings))])))
                continue
            did = self.doc_ids[rng.randrange(len(self.doc_ids))]
            text, doc_facts = docs[did], self.by_doc[did]
            if cfg.counterfactual and rng.random() < cfg.counterfactual:
                text, doc_facts = counterfactual_swap(rng, text, doc_facts, parse_contents(text)[0], self.pools)
            if phase == "retrieved":
                others = self._distractors(rng, did)
                segs = retrieved_reading_example(rng, did, {did: text, **{d: docs[d] for d in others}}, doc_facts,
                                                 others, chat=rng.random() < cfg.chat_share)
            elif phase in ("gap", "paraphrase"):
                first = rng.random() < cfg.question_first
                segs = reading_example(rng, text, doc_facts, None, question_first=first,
                                       gap=self._gap_text(rng) if rng.random() < cfg.gap_share else "")
            else:
                segs = reading_example(rng, text, doc_facts, phase)
            if segs is not None:
                rows.append(self._encode(segs))
        T = max(len(r[0]) for r in rows)
        x = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        m = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, (ids, trained) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
            m[i, :len(ids)] = torch.tensor(trained)
        return x, m, sum(len(ids) for ids, _ in rows)


def warmup_loss(model, batch: WarmupBatch) -> tuple[torch.Tensor, int]:
    """Sum of the parts' token cross-entropies on their trained positions; (loss, real tokens)."""
    loss = sum(weighted_lm_loss(model, x, torch.ones_like(x), x.masked_fill(~m, -100), m.float())[0]
               for x, m in batch.parts)
    return loss, batch.tokens


def loop_config(cfg: WarmupConfig, checkpoint_every: int = 50, log_every: int = 10,
                grad_accum: int = 1) -> LoopConfig:
    """The warm-up's optimisation: AdamW (0.9, 0.95), weight decay 0.01, a constant rate after an optional
    linear ramp (lr_warmup_steps), gradients clipped at 1."""
    return LoopConfig(steps=cfg.total_steps, optimizer="adamw", lr=cfg.lr, beta1=0.9, beta2=0.95, weight_decay=0.01,
                      schedule="constant", warmup_steps=cfg.lr_warmup_steps, grad_clip=1.0, grad_accum=grad_accum,
                      checkpoint_every=checkpoint_every, log_every=log_every)


def warm_up(ctx: JobContext, model, tokenizer, docs: Mapping[str, str], facts: Sequence[Fact], cfg: WarmupConfig,
            seed: int = 0, checkpoint_every: int = 50, log_every: int = 10, placement=None,
            compile: bool = False, grad_accum: int = 1) -> LoopResult:
    """Run the warm-up on ``model`` in place through the one loop (resuming from ctx's last checkpoint);
    placement: where it computes (prorag.training.devices; None = the model's device in float32); grad_accum:
    micro-batches each step's rows are split into (:meth:`WarmupBatches.micro_batch`)."""
    batches = WarmupBatches(tokenizer, docs, facts, cfg, seed)
    loop = loop_config(cfg, checkpoint_every, log_every, grad_accum)
    loop.compile = compile
    return run_loop(ctx, model, lambda i: batches.micro_batch(i, grad_accum), warmup_loss, loop,
                    placement=placement)


__all__ = ["WarmupBatch", "WarmupBatches", "loop_config", "phases", "warm_up", "warmup_loss"]
