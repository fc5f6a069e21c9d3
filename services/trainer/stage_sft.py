"""Stage 1: SFT warm-up on gold step-by-step trajectories (and the baselines trained the same way).

Data: the benchmark's gold decompositions rendered in ProRAG's step format, documents from the
live retriever service. Loss: ProRAG's format-aware per-token cross-entropy weights on generated
tokens only (prompt, retrieved documents and glue are masked). Full fine-tuning, as the paper does
for SFT (RL later trains LoRA adapters on top of this model).

Trained by the house loop (prorag.training.loop) rather than TRL's SFTTrainer because the loss
needs per-token weights (TRL offers completion-only masks, not weights) and the job machinery
needs exact resume: batch order from (seed, epoch) only, checkpoints through the JobContext.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from prorag import paths
from prorag.config import ConfigError, cfg_field
from prorag.data.loaders import Document, load_questions, load_split
from prorag.data.thoughts import OpenAIThoughtWriter
from prorag.data.world import canonical_question
from prorag.errors import FailedPrecondition
from prorag.methods import DOCS_PER_SEARCH, SFT_MODES
from prorag.modeling import load_for_training
from prorag.data.sft import length_grouped_batches
from prorag.training.context import JobContext
from prorag.io import atomic_path
from prorag.tokens import TokenTrajectory
from prorag.training.checkpoint import load_weights_file
from prorag.training.distributed import from_main
from prorag.training.lm import weighted_lm_loss
from prorag.training.loop import run_loop
from prorag.training.run_config import TrainRunConfig
from prorag.trajectory import FORMAT_LOSS_WEIGHTS, TAGS
from services.trainer.stages import publish_trained, register_stage


@dataclass
class SFTConfig(TrainRunConfig):
    """Supervised warm-up of the policy (mode agent) or of a baseline (no_retrieval, standard_rag)."""

    mode: str = cfg_field("agent", help="agent = ProRAG step format; no_retrieval / standard_rag = baselines",
                          choices=SFT_MODES)
    world: str = cfg_field("default", help="embedded world whose train split is used")
    questions: str = cfg_field("", help="FlashRAG-style train jsonl with decompositions ('' = the world's train split)")
    max_questions: int = cfg_field(0, help="use at most this many training questions (0 = all)", min=0)
    base_model: str = cfg_field("", help="required: the Hugging Face model directory to fine-tune (the stage never "
                                          "builds one; `prorag run` passes the embedded base)")
    retriever: str = cfg_field("127.0.0.1:50051", help="retriever service used to build the documents")
    retriever_index: str = cfg_field("", help="retriever index ('' = its default)")
    topk: int = cfg_field(DOCS_PER_SEARCH, help="documents per subquery (ProRAG: 3)", min=1, max=20)
    thoughts: str = cfg_field("template", help="template = offline thoughts; openai = rewritten by an LLM",
                              choices=("template", "openai"))
    openai_base_url: str = cfg_field("", help="OpenAI-compatible endpoint for thoughts='openai'")
    openai_model: str = cfg_field("gpt-4o", help="model used for thoughts='openai'")
    restate_question: bool = cfg_field(False, help="thoughts before a subanswer, a comparison's answer and a "
                                                    "baseline's answer end by restating the question they answer "
                                                    "(prorag.data.sft.restated), for every mode alike; measured to "
                                                    "help only on a base that copies (cpu-induction), see "
                                                    "docs/BENCHMARKS.md")
    plan_thoughts: bool = cfg_field(False, help="agent mode: each subquery's thought and the answer's begin with "
                                                 "the searches left (and 'then compare' for comparisons), "
                                                 "counting down to 'No searches to go.' (prorag.data.sft.plan_note)")
    canonical_subqueries: bool = cfg_field(False, help="agent mode: write each subquery in its relation's one "
                                                        "phrasing (prorag.data.world.canonical_question) instead of "
                                                        "the decomposition's randomly drawn one; sub-questions in "
                                                        "other phrasings are kept verbatim; measured to lift dev 2+ "
                                                        "hop F1 32.1 -> 51.1 (docs/BENCHMARKS.md)")
    hop_samples: bool = cfg_field(False, help="baselines: besides each whole question, train on one sample per gold "
                                               "hop (its sub-question, for standard_rag with that sub-question's "
                                               "top-k documents, the gold one among them, answered by its "
                                               "sub-answer), the reading the agent's subanswers train on "
                                               "(prorag.data.sft.hop_questions)")
    loss_weights: str = cfg_field("prorag", help="prorag = format-aware tag weights; uniform = plain CE",
                                  choices=("prorag", "uniform"))
    epochs: float = cfg_field(1.0, help="passes over the data (fractional allowed)", min=0.01, max=100)
    max_steps: int = cfg_field(0, help="optimizer steps; overrides epochs when > 0", min=0)
    batch_size: int = cfg_field(16, help="sequences per optimizer step", min=1, max=4096)
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step, batch_size split evenly among them "
                                        "(less memory per forward pass, same step)", min=1, max=4096)
    lr: float = cfg_field(1e-3, help="peak learning rate (linear warm-up, cosine decay)", min=0.0, max=1.0)
    weight_decay: float = cfg_field(0.01, help="AdamW weight decay", min=0.0, max=1.0)
    max_len: int = cfg_field(2048, help="longest training sequence in tokens; longer ones are dropped", min=16)
    publish_name: str = cfg_field("", help="publish the model as name@<job id> under data/models/<world> ('' = mode)")

    def validate(self) -> None:
        super().validate()
        if not self.base_model:
            raise ConfigError("base_model", "required: the model directory to fine-tune")
        if not Path(self.base_model).is_dir():
            raise ConfigError("base_model", f"{self.base_model} is not a directory")
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")


# ---------------------------------------------------------------- data
def build_samples(cfg: SFTConfig, tokenizer, progress=None) -> tuple[list, dict]:
    """Encoded samples (TokenTrajectory, one per question) for cfg.mode; documents come from the retriever."""
    from prorag.rpc.clients import RetrieverClient
    from prorag.data.sft import (agent_prompt, agent_steps, baseline_prompt, baseline_steps, encode_segments,
                                 ensure_gold, hop_questions, template_thought)

    qs = load_questions(cfg.questions) if cfg.questions else load_split(paths.world_dir(cfg.world), "train")
    if cfg.max_questions:
        qs = qs[:cfg.max_questions]
    thought = template_thought
    if cfg.thoughts == "openai":
        thought = OpenAIThoughtWriter(cfg.openai_base_url, cfg.openai_model,
                                      cache_path=paths.data_dir() / "cache" / "thoughts.jsonl")
    tag_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    weights = FORMAT_LOSS_WEIGHTS if cfg.loss_weights == "prorag" else {}
    client = RetrieverClient(cfg.retriever, timeout=300)

    def search(queries: list[str]) -> dict[str, list[Document]]:
        out = {}
        uniq = sorted(set(queries))
        for i in range(0, len(uniq), 256):
            chunk = uniq[i:i + 256]
            out.update(zip(chunk, client.search(chunk, topk=cfg.topk, index=cfg.retriever_index)))
            if progress:
                progress(min(i + 256, len(uniq)), len(uniq))
        return out

    samples, stats = [], {"questions": len(qs), "dropped_too_long": 0, "dropped_no_decomposition": 0}
    try:
        if cfg.mode == "agent":
            subs = [s for q in qs for s in q.decomposition if s.doc_id]
            # each sub-question rewritten once, used for its retrieval and in every trajectory that holds it
            written = {s.question: canonical_question(s.question) if cfg.canonical_subqueries else s.question
                       for s in subs}
            phrasing = written.__getitem__
            retrieved = search(list(written.values()))
            gold = {d.id: d for d in client.get_documents(sorted({s.doc_id for s in subs}))}
            for q in qs:
                if not any(s.doc_id for s in q.decomposition):
                    stats["dropped_no_decomposition"] += 1
                    continue
                steps = agent_steps(q, retrieved, gold, topk=cfg.topk, thought=thought,
                                    restate=cfg.restate_question, plan=cfg.plan_thoughts, phrasing=phrasing)
                samples.append(encode_segments(tokenizer, agent_prompt(q.question), steps, tag_ids, weights))
        else:
            hops = [h for q in qs for h in hop_questions(q)] if cfg.hop_samples else []
            rag = cfg.mode == "standard_rag"
            # With one document per question a hop's reading sample holds exactly its gold document whatever the
            # search returns (ensure_gold), so its sub-question is not searched (18,000 searches, ~40 s, saved).
            searched = qs + hops if cfg.topk > 1 else qs
            docs = search([q.question for q in searched]) if rag else {}
            if rag and hops:  # a hop's reading sample always holds the document that answers it
                gold = {d.id: d for d in client.get_documents(sorted({h.decomposition[0].doc_id for h in hops}))}
                for h in hops:
                    docs[h.question] = ensure_gold(docs.get(h.question, []), gold[h.decomposition[0].doc_id],
                                                   cfg.topk)
            stats["hop_samples"] = len(hops)
            for q in qs + hops:
                prompt = baseline_prompt(q.question, docs.get(q.question) if rag else None)
                steps = baseline_steps(q, grounded=rag, thought=thought, restate=cfg.restate_question)
                samples.append(encode_segments(tokenizer, prompt, steps, tag_ids, weights))
    finally:
        client.close()
    kept = [s for s in samples if len(s.token_ids) <= cfg.max_len]
    stats["dropped_too_long"] = len(samples) - len(kept)
    stats["samples"] = len(kept)
    # ProRAG counts one sample per step (its 109k SFT "context-action pairs"); a sample here is a whole
    # trajectory, so its steps are the number to compare with the paper's
    stats["context_action_pairs"] = sum(len(s.spans) for s in kept)
    stats["tokens"] = sum(len(s.token_ids) for s in kept)
    stats["trained_tokens"] = sum(s.generated_tokens for s in kept)
    if not kept:
        raise FailedPrecondition("no training samples: every sequence was longer than max_len or had no decomposition")
    return kept, stats


def collate(samples, pad_id: int):
    """[B] samples -> input_ids [B,T], attention [B,T], labels [B,T] (-100 off the loss), weights [B,T]."""
    T = max(len(s.token_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    w = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        attn[i, :n] = 1
        lab = torch.tensor(s.token_ids)
        lab[torch.tensor(s.generated_mask) == 0] = -100
        labels[i, :n] = lab
        w[i, :n] = torch.tensor(s.weights)
    return ids, attn, labels, w


# ---------------------------------------------------------------- stage
def load_to_fine_tune(ctx: JobContext, cfg: TrainRunConfig, base: Path):
    """(model, tokenizer) of ``base``, placed for training with the job's threads and seed set; shared by the SFT
    and RFT stages."""
    cfg.apply_threads()
    ctx.seed_everything(cfg.seed)
    return load_for_training(base, cfg.placement(), gradient_checkpointing=cfg.gradient_checkpointing)


def kept_trajectories(ctx: JobContext, file_name: str, build: Callable[[], tuple[list, dict]]) -> tuple[list, dict]:
    """The (token trajectories, stats) a fine-tuning job trains on: built once by ``build`` and kept with the
    checkpoints as ``file_name``, so a resumed job trains on identical samples. Saved as plain lists and loaded with
    weights_only: nothing in the job store is unpickled into code. On a launch of several processes only the main
    one builds (through the services) and keeps them; the others get its data. Shared by the SFT and RFT stages."""
    data_path = ctx.checkpoint_dir / file_name

    def data() -> dict:
        if data_path.exists():
            return load_weights_file(data_path)
        samples, stats = build()
        blob = {"samples": [s.to_dict() for s in samples], "stats": stats}
        with atomic_path(data_path) as tmp:
            torch.save(blob, tmp)
        return blob

    blob = from_main(ctx.accelerator, data)
    samples, stats = [TokenTrajectory.from_dict(d) for d in blob["samples"]], blob["stats"]
    ctx.emit(0, 1, message=f"data: {stats}")
    return samples, stats


def run_sft(ctx: JobContext) -> dict:
    cfg: SFTConfig = ctx.config
    base = Path(cfg.base_model)
    model, tokenizer = load_to_fine_tune(ctx, cfg, base)

    def build() -> tuple[list, dict]:
        ctx.emit(0, 1, message=f"building {cfg.mode} training data through the retriever at {cfg.retriever}")
        return build_samples(cfg, tokenizer)

    samples, stats = kept_trajectories(ctx, "sft_data.pt", build)
    name = cfg.publish_name or ("sft" if cfg.mode == "agent" else cfg.mode)
    return fit_and_publish(ctx, cfg, model, tokenizer, samples, stats, base=base, name=name, stage="sft",
                           max_steps=cfg.max_steps)


def fit_and_publish(ctx: JobContext, cfg: TrainRunConfig, model, tokenizer, samples, stats: dict, *, base: Path,
                    name: str, stage: str, max_steps: int = 0) -> dict:
    """Fine-tune ``model`` on token trajectories (loss on generated tokens, weighted) with the one training loop,
    then publish it as name@<job id> in cfg.world's model registry. Shared by the SFT and RFT stages; ``cfg`` is
    either's config: the shared run fields, plus batch_size, grad_accum, epochs and world, named alike in both.
    max_steps: optimizer steps, overriding epochs when > 0."""
    # batch_size sequences per optimizer step, as grad_accum length-grouped micro-batches
    micro = cfg.batch_size // cfg.grad_accum
    per_epoch = math.ceil(len(samples) / micro)
    total = max_steps or max(1, int(round(per_epoch * cfg.epochs / cfg.grad_accum)))
    orders: dict[int, list[list[int]]] = {}
    lengths = [len(s.token_ids) for s in samples]

    def batch_at(i: int):
        # the order is a function of (seed, epoch) only, so a resumed job sees the same batches
        epoch, j = divmod(i, per_epoch)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = length_grouped_batches(lengths, micro, cfg.seed * 1_000_003 + epoch)
        return collate([samples[k] for k in orders[epoch][j]], tokenizer.pad_token_id)

    placement = cfg.placement()
    sum_ce = placement.sum_ce()  # the fused head-and-CE kernel when fused_linear_ce asks for it

    def loss_fn(m, batch):
        ids, attn, labels, w = batch
        # throughput over every real token
        return weighted_lm_loss(m, ids, attn, labels, w, sum_ce=sum_ce)[0], int(attn.sum())

    result = run_loop(ctx, model, batch_at, loss_fn, cfg.loop_config(total, grad_accum=cfg.grad_accum),
                      placement=placement)
    if not result.completed:
        return {}
    loss_v = result.loss
    out = publish_trained(ctx, model, tokenizer, kind="model", world=cfg.world, name=name, base=base, stage=stage,
                          metrics={"final_loss": loss_v}, step=total)
    if out is None:  # the other processes of a launch publish nothing
        return {}
    models, ref = out
    published = models.path(ref)
    ctx.emit(total, total, message=f"published {name}@{ctx.job_id} at {published}")
    return {"final_loss": loss_v, "steps": total, "model": ref.key,
            **{f"data_{k}": float(v) for k, v in stats.items()}}


register_stage("sft", SFTConfig, run_sft,
               description="SFT warm-up on gold step-by-step trajectories with the format-aware loss "
                           "(mode=no_retrieval/standard_rag trains the baselines the same way)")
