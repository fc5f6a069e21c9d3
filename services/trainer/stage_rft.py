"""Stage 3: PRM-guided rejection-sampling fine-tuning (RFT).

Sample several trajectories per train question from the SFT policy through the policy service (live retrieval),
score every step of the correct ones with the PRM service (one batched call per chunk of questions, all steps
of a trajectory in one pass), keep a trajectory when its answer is correct, its format valid and every step
scores at or above the threshold (``algorithms.rl.rft_keep``), and fine-tune on the kept ones with the SFT
stage's loop and format-aware loss. Training on a whole trajectory with the loss on its generated tokens is
the reference's "one sample per step" in one pass: each step is predicted from exactly the context before it.
Without a PRM (``prm=''``) the filter is the outcome alone: the "RFT only" baseline of the ablations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.config import cfg_field
from prorag.errors import FailedPrecondition
from prorag.training.context import JobContext
from prorag.training.run_config import TrainRunConfig
from services.trainer.stage_sft import fit_and_publish
from services.trainer.stages import register_stage, resolve_model


@dataclass
class RFTConfig(TrainRunConfig):
    """Sample from the policy, keep what is correct and PRM-approved, fine-tune on it."""

    world: str = cfg_field("default", help="embedded world whose questions are sampled")
    split: str = cfg_field("train", help="split whose questions are sampled (never the test split)")
    max_questions: int = cfg_field(0, help="questions sampled, the split's first ones (0 = all)", min=0)
    base_model: str = cfg_field("", help="required: the SFT model to fine-tune (a directory or name@version in the "
                                         "world's registry); the policy service should serve the same model, so "
                                         "the samples are on-policy")
    policy: str = cfg_field("127.0.0.1:50052", help="policy service that samples the trajectories")
    adapter: str = cfg_field("", help="policy adapter name@version ('' = the active one)")
    retriever_index: str = cfg_field("", help="retriever index the policy's rollouts search ('' = its default)")
    topk: int = cfg_field(1, help="documents per subquery, as the policy was trained (the embedded agent: 1; "
                                  "ProRAG: 3)", min=1, max=20)
    samples_per_question: int = cfg_field(8, help="trajectories sampled per question", min=1, max=64)
    temperature: float = cfg_field(0.8, help="sampling temperature (ProRAG: 0.8)", min=0.0, max=5.0)
    max_step_tokens: int = cfg_field(128, help="most tokens of one generated step", min=8, max=4096)
    max_steps: int = cfg_field(13, help="steps of a trajectory at most (ProRAG: 13 for RFT)", min=1, max=64)
    questions_per_request: int = cfg_field(32, help="questions in one Rollout request (and one PRM call)",
                                           min=1, max=4096)
    prm: str = cfg_field("127.0.0.1:50053", help="PRM service that scores the steps ('' = no step filter: the "
                                                 "outcome alone, the RFT-only baseline)")
    prm_threshold: float = cfg_field(0.0, help="lowest PRM score (logit) a kept trajectory's steps may have "
                                               "(ProRAG: 0)")
    prm_keep_fraction: float = cfg_field(0.0, help="when > 0, replaces prm_threshold: keep the correct trajectories "
                                                   "whose weakest step is among the best this fraction "
                                                   "(algorithms.rl.rft_threshold); for a PRM whose logits carry an "
                                                   "offset, as a Bradley-Terry PRM's may", min=0.0, max=1.0)
    correct: str = cfg_field("em", help="what counts as a correct answer: em = exact match after the shared "
                                        "normaliser (ProRAG), f1 = token F1 >= min_f1", choices=("em", "f1"))
    min_f1: float = cfg_field(0.8, help="with correct=f1: the lowest F1 that counts as correct", min=0.0, max=1.0)
    max_per_question: int = cfg_field(4, help="kept trajectories per question at most (distinct texts; 0 = all), "
                                              "so easy questions do not crowd out the others", min=0)
    replay: float = cfg_field(0.0, help="gold SFT trajectories mixed in per kept one, built as the base model's SFT "
                                        "job built its data (from its published config) for the train split's "
                                        "first questions: keeps the hops the policy rarely answers correctly, "
                                        "and so rarely keeps, in the data (0 = kept trajectories only)",
                                min=0.0, max=100.0)
    retriever: str = cfg_field("127.0.0.1:50051", help="retriever service the replayed SFT trajectories' documents "
                                                       "come from (used only with replay > 0)")
    loss_weights: str = cfg_field("prorag", help="prorag = format-aware tag weights; uniform = plain CE",
                                  choices=("prorag", "uniform"))
    epochs: float = cfg_field(1.0, help="passes over the kept trajectories (ProRAG: 1)", min=0.01, max=100)
    max_train_steps: int = cfg_field(0, help="optimizer steps; overrides epochs when > 0", min=0)
    batch_size: int = cfg_field(16, help="sequences per optimizer step", min=1, max=4096)
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step", min=1, max=4096)
    lr: float = cfg_field(2e-4, help="peak learning rate (linear warm-up, cosine decay)", min=0.0, max=1.0)
    weight_decay: float = cfg_field(0.01, help="AdamW weight decay", min=0.0, max=1.0)
    max_len: int = cfg_field(2048, help="longest kept trajectory in tokens; longer ones are dropped", min=16)
    publish_name: str = cfg_field("rft", help="publish the model as name@<job id> under data/models/<world>")

    def validate(self) -> None:
        from prorag.config import ConfigError

        super().validate()
        if not self.base_model:
            raise ConfigError("base_model", "required: the SFT model to fine-tune")
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")
        if self.split == "test":
            raise ConfigError("split", "RFT never trains on the test split's questions")


def is_correct(cfg: RFTConfig, answer: str, golds) -> bool:
    from prorag.metrics import exact_match, f1_score

    if cfg.correct == "em":
        return exact_match(answer, golds) == 1.0
    return f1_score(answer, golds) >= cfg.min_f1


def sample_and_filter(cfg: RFTConfig, tokenizer, progress=None) -> tuple[list, dict]:
    """Kept trajectories (TokenTrajectory, format-aware weights on generated tokens) and counts of what was
    sampled, correct, PRM-approved and kept."""
    from prorag.algorithms.rl import rft_keep, rft_threshold
    from prorag.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from prorag.pbconv import step_from_pb, token_trace_from_pb
    from prorag.trajectory import FORMAT_LOSS_WEIGHTS, TAGS, format_loss_weights

    qs = load_split(paths.world_dir(cfg.world), cfg.split)
    if cfg.max_questions:
        qs = qs[:cfg.max_questions]
    tag_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    weights = FORMAT_LOSS_WEIGHTS if cfg.loss_weights == "prorag" else {}
    stats = {"questions": len(qs), "sampled": 0, "answered": 0, "correct": 0, "prm_scored": 0, "prm_passed": 0,
             "kept": 0, "dropped_duplicate": 0, "dropped_too_long": 0, "questions_with_kept": 0}
    kept: list = []
    candidates: list = []  # (correct trajectory, its step scores): filtered once all are scored
    per_question: dict[str, set[str]] = {}
    policy = PolicyClient(cfg.policy, timeout=3600)
    prm = PRMClient(cfg.prm, timeout=600) if cfg.prm else None
    prm_version = ""
    try:
        for start in range(0, len(qs), cfg.questions_per_request):
            chunk = qs[start:start + cfg.questions_per_request]
            by_id = {q.id: q for q in chunk}
            sampling = policy.sampling(n=cfg.samples_per_question, temperature=cfg.temperature,
                                       max_tokens=cfg.max_step_tokens, seed=cfg.seed * 7919 + start + 1)
            correct = []
            for t in policy.rollout([(q.id, q.question) for q in chunk], sampling, max_steps=cfg.max_steps,
                                    topk=cfg.topk, retriever_index=cfg.retriever_index, adapter=cfg.adapter):
                if not hasattr(t, "question_id"):
                    continue  # the summary
                stats["sampled"] += 1
                if t.finish_reason != "answer":
                    continue
                stats["answered"] += 1
                if t.format_valid and is_correct(cfg, t.answer, by_id[t.question_id].golden_answers):
                    stats["correct"] += 1
                    correct.append(t)
            scores: list[list[float]] = [[] for _ in correct]
            if prm is not None and correct:
                # one call for the chunk: every step of every correct trajectory, each trajectory in one pass
                prm_version, scores = prm.score([(t.question, [step_from_pb(s) for s in t.steps], False)
                                                 for t in correct])
                stats["prm_scored"] += len(correct)
            candidates += zip(correct, scores)
            if progress:
                progress(min(start + len(chunk), len(qs)), len(qs))
    finally:
        policy.close()
        if prm is not None:
            prm.close()
    threshold = cfg.prm_threshold
    if prm is not None and cfg.prm_keep_fraction > 0:
        threshold = rft_threshold([min(sc) for _, sc in candidates if sc], cfg.prm_keep_fraction)
    stats["prm_threshold"] = threshold
    for t, step_scores in candidates:
        if not rft_keep(True, t.format_valid, step_scores, threshold):
            continue
        stats["prm_passed"] += 1
        seen = per_question.setdefault(t.question_id, set())
        if t.text in seen or (cfg.max_per_question and len(seen) >= cfg.max_per_question):
            stats["dropped_duplicate"] += 1
            continue
        traj = token_trace_from_pb(t.trace, t.prompt_length)
        if len(traj.token_ids) > cfg.max_len:
            stats["dropped_too_long"] += 1
            continue
        seen.add(t.text)
        w = format_loss_weights(traj.token_ids, tag_ids, weights)
        traj.weights = [float(x) if m else 0.0 for x, m in zip(w, traj.generated_mask)]
        kept.append(traj)
    stats["kept"] = len(kept)
    stats["questions_with_kept"] = sum(1 for s in per_question.values() if s)
    if not kept:
        raise FailedPrecondition(f"RFT kept no trajectory ({stats}): the policy answered none correctly or the PRM "
                                 "scored every correct one below the threshold; sample more, lower prm_threshold, "
                                 "or set prm_keep_fraction (a Bradley-Terry PRM's logits carry an offset)")
    return kept, {**stats, "prm_version": prm_version}


def replay_samples(cfg: RFTConfig, base: Path, tokenizer, n: int) -> list:
    """``n`` gold SFT trajectories, encoded as the SFT job that trained ``base`` encoded its own (its published
    config's format settings), for the train split's first ``n`` questions."""
    import dataclasses

    from prorag.config import from_dict
    from prorag.registry import published_config
    from services.trainer.stage_sft import SFTConfig, build_samples

    if n <= 0:
        return []
    trained = published_config(base)
    if trained.get("stage", "sft") != "sft" or not trained:
        raise FailedPrecondition(f"RFT replay needs the SFT job's config to rebuild its data, and {base} was not "
                                 "published by an SFT job; set replay 0")
    names = {f.name for f in dataclasses.fields(SFTConfig)}
    sft = from_dict(SFTConfig, {**{k: v for k, v in trained.items() if k in names}, "world": cfg.world,
                                "retriever": cfg.retriever, "retriever_index": cfg.retriever_index,
                                "questions": "", "max_questions": n, "base_model": str(base)})
    samples, _ = build_samples(sft, tokenizer)
    return samples[:n]


def run_rft(ctx: JobContext) -> dict:
    import torch

    from prorag.io import atomic_path
    from prorag.modeling import load_for_training
    from prorag.tokens import TokenTrajectory
    from prorag.training.checkpoint import load_weights_file
    from prorag.training.distributed import from_main

    cfg: RFTConfig = ctx.config
    cfg.apply_threads()
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    ctx.seed_everything(cfg.seed)
    model, tokenizer = load_for_training(base, cfg.placement(), gradient_checkpointing=cfg.gradient_checkpointing)
    # Sampled once and kept with the checkpoints, so a resumed job trains on the same trajectories (plain lists,
    # loaded weights-only).
    data_path = ctx.checkpoint_dir / "rft_data.pt"

    def data() -> dict:
        if data_path.exists():
            return load_weights_file(data_path)
        ctx.emit(0, 1, message=f"sampling {cfg.samples_per_question} trajectories per question through the policy "
                               f"at {cfg.policy}" + (f", steps scored by the PRM at {cfg.prm}" if cfg.prm else ""))
        samples, stats = sample_and_filter(cfg, tokenizer,
                                           progress=lambda d, n: ctx.emit(0, 1, message=f"sampled {d}/{n} questions"))
        if cfg.replay > 0:
            replayed = replay_samples(cfg, base, tokenizer, round(cfg.replay * len(samples)))
            samples, stats = samples + replayed, {**stats, "replayed": len(replayed)}
        blob = {"samples": [s.to_dict() for s in samples], "stats": stats}
        with atomic_path(data_path) as tmp:
            torch.save(blob, tmp)
        return blob

    # on a launch of several processes only the main one samples through the services; the others get its data
    blob = from_main(ctx.accelerator, data)
    samples, stats = [TokenTrajectory.from_dict(d) for d in blob["samples"]], blob["stats"]
    ctx.emit(0, 1, message=f"data: {stats}")
    prm_version = stats.pop("prm_version", "")
    out = fit_and_publish(ctx, cfg, model, tokenizer, samples, stats, base=base, name=cfg.publish_name,
                          stage="rft", max_steps=cfg.max_train_steps)
    return {**out, "prm_version": prm_version} if out else out


register_stage("rft", RFTConfig, run_rft,
               description="PRM-guided rejection-sampling fine-tuning: sample through the policy, keep correct "
                           "trajectories whose every step the PRM approves, fine-tune on them",
               checks={"base_model": "model"})
