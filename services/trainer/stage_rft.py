"""Stage 3: PRM-guided rejection-sampling fine-tuning (RFT).

Draw train questions (evenly over hop counts with ``hop_balanced``), sample several trajectories per question
from the SFT policy through the policy service (live retrieval), score every step of the correct, format-valid
ones with the PRM service (one batched call per chunk of questions, all steps of a trajectory in one pass; the
logits optionally centred per step kind, ``prm_centering``), filter, and fine-tune on what is kept with the SFT
stage's loop and format-aware loss (``fit_and_publish``). Two filters:

- ``filter=step``, ProRAG's RFT (the default): every correct, format-valid trajectory is kept, with the loss only
  on the generated tokens of the steps whose score reaches the threshold (``algorithms.rl.rft_kept_steps``,
  ``step_loss_mask``); the other steps stay in the sequence as context. A trajectory with no such step is
  dropped. One sequence with the loss on its kept steps trains the same targets in the same contexts as the
  reference's one sample per kept step.
- ``filter=trajectory``: a trajectory is kept only when every step reaches the threshold
  (``algorithms.rl.rft_keep``), with the loss on all its steps. This is not the reference's filter: one weak step
  drops all the others, so it favours short trajectories (fewer steps, fewer chances to fall below).

Without a PRM (``prm=''``) the filter is the outcome alone: the "RFT only" baseline of the ablations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.algorithms.rl import (PRM_CENTERINGS, center_per_kind, hop_balanced_sample, rft_keep, rft_kept_steps,
                                  rft_threshold, step_loss_mask)
from prorag.config import ConfigError, cfg_field, from_dict
from prorag.data.loaders import load_split
from prorag.data.world.config import TEST_SPLITS
from prorag.errors import FailedPrecondition
from prorag.metrics import exact_match, f1_score
from prorag.registry import published_config
from prorag.rpc.clients import PolicyClient, PRMClient
from prorag.rpc.pbconv import step_from_pb, token_trace_from_pb
from prorag.training.context import JobContext
from prorag.training.run_config import TrainRunConfig
from prorag.trajectory import FORMAT_LOSS_WEIGHTS, TAGS, format_loss_weights
from services.trainer.sampling import prm_logits, rollout, rollout_index_field, rollout_topk_field, step_tokens_field
from services.trainer.stage_sft import SFTConfig, build_samples, fit_and_publish, kept_trajectories, load_to_fine_tune
from services.trainer.stages import register_stage, resolve_model


@dataclass
class RFTConfig(TrainRunConfig):
    """Sample from the policy, keep what is correct and PRM-approved, fine-tune on it."""

    world: str = cfg_field("default", help="embedded world whose questions are sampled")
    split: str = cfg_field("train", help="split whose questions are sampled (never the test split)")
    max_questions: int = cfg_field(0, help="questions sampled (0 = all): the split's first ones, or a seeded draw "
                                           "evenly over hop counts with hop_balanced", min=0)
    hop_balanced: bool = cfg_field(True, help="with max_questions > 0, draw the questions evenly over hop counts "
                                              "(algorithms.rl.hop_balanced_sample, seeded by seed) instead of "
                                              "taking the split's first ones: the policy answers shallow questions "
                                              "correctly far more often, so they would fill the kept data")
    base_model: str = cfg_field("", help="required: the SFT model to fine-tune (a directory or name@version in the "
                                         "world's registry); the policy service should serve the same model, so "
                                         "the samples are on-policy")
    policy: str = cfg_field("127.0.0.1:50052", help="policy service that samples the trajectories")
    adapter: str = cfg_field("", help="policy adapter name@version ('' = the active one)")
    retriever_index: str = rollout_index_field()
    topk: int = rollout_topk_field(" (the embedded agent: 1; ProRAG: 3)")
    samples_per_question: int = cfg_field(8, help="trajectories sampled per question", min=1, max=64)
    temperature: float = cfg_field(0.8, help="sampling temperature (ProRAG: 0.8)", min=0.0, max=5.0)
    max_step_tokens: int = step_tokens_field()
    max_steps: int = cfg_field(13, help="steps of a trajectory at most (ProRAG: 13 for RFT)", min=1, max=64)
    questions_per_request: int = cfg_field(32, help="questions in one Rollout request (and one PRM call)",
                                           min=1, max=4096)
    prm: str = cfg_field("127.0.0.1:50053", help="PRM service that scores the steps ('' = no step filter: the "
                                                 "outcome alone, the RFT-only baseline)")
    filter: str = cfg_field("step", help="step = ProRAG's RFT: every correct, format-valid trajectory, the loss on "
                                         "its steps whose PRM score reaches the threshold (the others stay as "
                                         "context; none passes: dropped); trajectory = only trajectories whose every "
                                         "step reaches it, the loss on all their steps", choices=("step", "trajectory"))
    prm_threshold: float = cfg_field(0.0, help="lowest PRM score (logit, after prm_centering) a step may have: to "
                                               "carry the loss (filter=step), or for its trajectory to be kept "
                                               "(filter=trajectory) (ProRAG: 0)")
    prm_keep_fraction: float = cfg_field(0.0, help="when > 0, replaces prm_threshold by the score that lets this "
                                                   "fraction through (algorithms.rl.rft_threshold): of the scored "
                                                   "steps (filter=step), or of the correct trajectories by their "
                                                   "weakest step (filter=trajectory); for a PRM whose logits carry an "
                                                   "offset, as a Bradley-Terry PRM's may", min=0.0, max=1.0)
    prm_centering: str = cfg_field("none", help="PRM logits as they come (none) or centred per step kind before the "
                                                "threshold (per_kind: each kind's mean over every step of the job's "
                                                "scored trajectories, each step counted once, is subtracted; a "
                                                "Bradley-Terry PRM leaves each kind at its own offset, so one "
                                                "threshold would keep mostly the high-offset kinds)",
                                   choices=PRM_CENTERINGS)
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
    service_wait_s: float = cfg_field(300.0, help="how long a rollout or PRM call waits, in all, for a policy or "
                                                  "PRM service that went away (UNAVAILABLE) to come back before "
                                                  "the job fails (UNAVAILABLE, naming the service and its "
                                                  "address); the call is made again whole with the same seed",
                                      min=0.0)

    def validate(self) -> None:
        super().validate()
        if not self.base_model:
            raise ConfigError("base_model", "required: the SFT model to fine-tune")
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")
        if self.split in TEST_SPLITS:
            raise ConfigError("split", f"RFT never trains on {self.split!r}: the final figures are read on it")


def is_correct(cfg: RFTConfig, answer: str, golds) -> bool:
    if cfg.correct == "em":
        return exact_match(answer, golds) == 1.0
    return f1_score(answer, golds) >= cfg.min_f1


def select_questions(cfg: RFTConfig, questions: list) -> list:
    """The questions sampled: all of them, or ``max_questions`` of them, drawn evenly over hop counts
    (hop_balanced) or the split's first ones."""
    if not cfg.max_questions:
        return questions
    if not cfg.hop_balanced:
        return questions[:cfg.max_questions]
    return [questions[i] for i in hop_balanced_sample([q.hops for q in questions], cfg.max_questions, cfg.seed)]


def kept_steps(cfg: RFTConfig, scores: list[list[float]], kinds: list[list[str]], format_valid: list[bool],
               scored: bool) -> tuple[list[list[bool]], float]:
    """Which steps of each correct trajectory carry the loss, [N][S_i], and the threshold used.

    scores [N][S_i]: the PRM logits of every step of the N correct trajectories (empty lists when ``scored`` is
    False: no PRM, every step of a format-valid trajectory kept); kinds [N][S_i]: each step's Step.kind."""
    if not scored:
        return [[ok] * len(ks) for ok, ks in zip(format_valid, kinds)], cfg.prm_threshold
    if cfg.prm_centering == "per_kind":
        # one pool for the whole job: a question's few correct samples are too few to estimate a kind's offset
        scores = center_per_kind(scores, kinds, [[1.0] * len(ks) for ks in kinds])
    threshold = cfg.prm_threshold
    if cfg.prm_keep_fraction > 0:
        pool = ([x for sc in scores for x in sc] if cfg.filter == "step" else [min(sc) for sc in scores if sc])
        threshold = rft_threshold(pool, cfg.prm_keep_fraction)
    if cfg.filter == "step":
        return [rft_kept_steps(True, ok, sc, threshold) for ok, sc in zip(format_valid, scores)], threshold
    return [[rft_keep(True, ok, sc, threshold)] * len(ks) for ok, sc, ks in zip(format_valid, scores, kinds)], threshold


def sample_and_filter(cfg: RFTConfig, tokenizer, progress=None) -> tuple[list, dict]:
    """Kept trajectories (TokenTrajectory, format-aware weights on the generated tokens of their kept steps, 0
    elsewhere) and counts of what was sampled, correct, PRM-approved and kept; steps kept of all the correct
    trajectories' steps per step kind (steps_kept_<kind>, steps_total_<kind>) and questions, correct and kept
    trajectories per hop count (questions_hops_<h>, correct_hops_<h>, kept_hops_<h>)."""
    qs = select_questions(cfg, load_split(paths.world_dir(cfg.world), cfg.split))
    hops = {q.id: q.hops for q in qs}
    tag_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    weights = FORMAT_LOSS_WEIGHTS if cfg.loss_weights == "prorag" else {}
    stats = {"questions": len(qs), "sampled": 0, "answered": 0, "correct": 0, "prm_scored": 0, "prm_passed": 0,
             "kept": 0, "dropped_duplicate": 0, "dropped_too_long": 0, "questions_with_kept": 0, "service_retries": 0}

    def count(key: str) -> None:
        stats[key] = stats.get(key, 0) + 1

    for q in qs:
        count(f"questions_hops_{q.hops}")
        stats.setdefault(f"correct_hops_{q.hops}", 0)
        stats.setdefault(f"kept_hops_{q.hops}", 0)
    # 1. sample; keep the correct, format-valid trajectories with their steps and PRM logits
    candidates: list = []  # (trajectory, its steps, its step scores): filtered once all are scored
    policy = PolicyClient(cfg.policy, timeout=3600)
    prm = PRMClient(cfg.prm, timeout=600) if cfg.prm else None
    prm_version = ""
    try:
        for start in range(0, len(qs), cfg.questions_per_request):
            chunk = qs[start:start + cfg.questions_per_request]
            by_id = {q.id: q for q in chunk}
            correct = []
            for t in rollout(policy, cfg, chunk, cfg.samples_per_question, cfg.seed * 7919 + start + 1, cfg.adapter,
                             stats):
                stats["sampled"] += 1
                if t.finish_reason != "answer":
                    continue
                stats["answered"] += 1
                if t.format_valid and is_correct(cfg, t.answer, by_id[t.question_id].golden_answers):
                    stats["correct"] += 1
                    count(f"correct_hops_{hops[t.question_id]}")
                    correct.append((t, [step_from_pb(s) for s in t.steps]))
            scores: list[list[float]] = [[] for _ in correct]
            if prm is not None and correct:
                # one call for the chunk: every step of every correct trajectory, each trajectory in one pass
                prm_version, scores = prm_logits(prm, cfg, [(t.question, steps, False) for t, steps in correct], stats)
                stats["prm_scored"] += len(correct)
            candidates += [(t, steps, sc) for (t, steps), sc in zip(correct, scores)]
            if progress:
                progress(min(start + len(chunk), len(qs)), len(qs))
    finally:
        policy.close()
        if prm is not None:
            prm.close()
    # 2. filter: which steps of which trajectories carry the loss
    kinds = [[st.kind for st in steps] for _, steps, _ in candidates]
    flags, threshold = kept_steps(cfg, [sc for _, _, sc in candidates], kinds,
                                  [bool(t.format_valid) for t, _, _ in candidates], scored=prm is not None)
    stats["prm_threshold"] = threshold
    for ks in kinds:
        for k in ks:
            count(f"steps_total_{k}")
            stats.setdefault(f"steps_kept_{k}", 0)
    # 3. the kept ones as token sequences, the loss on their kept steps only
    kept: list = []
    per_question: dict[str, set[str]] = {}
    for (t, _, _), step_kinds, keep in zip(candidates, kinds, flags):
        if not any(keep):
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
        if len(traj.spans) != len(keep):
            raise FailedPrecondition(f"trajectory {t.question_id}#{t.sample_index}: {len(keep)} steps and "
                                     f"{len(traj.spans)} token spans do not line up")
        seen.add(t.text)
        w = format_loss_weights(traj.token_ids, tag_ids, weights)
        on = step_loss_mask(keep, traj.spans, len(traj.token_ids))
        traj.weights = [float(x) if g and m else 0.0 for x, g, m in zip(w, traj.generated_mask, on)]
        kept.append(traj)
        count(f"kept_hops_{hops[t.question_id]}")
        for k, m in zip(step_kinds, keep):
            stats[f"steps_kept_{k}"] += int(m)
    stats["kept"] = len(kept)
    stats["questions_with_kept"] = sum(1 for s in per_question.values() if s)
    if not kept:
        raise FailedPrecondition(f"RFT kept no trajectory ({stats}): the policy answered none correctly or the PRM "
                                 "scored every step below the threshold; sample more, lower prm_threshold, set "
                                 "prm_centering=per_kind, or set prm_keep_fraction (a Bradley-Terry PRM's logits "
                                 "carry an offset)")
    return kept, {**stats, "prm_version": prm_version}


def replay_samples(cfg: RFTConfig, base: Path, tokenizer, n: int) -> list:
    """``n`` gold SFT trajectories, encoded as the SFT job that trained ``base`` encoded its own (its published
    config's format settings), for the train split's first ``n`` questions."""
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
    cfg: RFTConfig = ctx.config
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    model, tokenizer = load_to_fine_tune(ctx, cfg, base)

    def sample() -> tuple[list, dict]:
        ctx.emit(0, 1, message=f"sampling {cfg.samples_per_question} trajectories per question through the policy "
                               f"at {cfg.policy}" + (f", steps scored by the PRM at {cfg.prm}" if cfg.prm else ""))
        samples, stats = sample_and_filter(cfg, tokenizer,
                                           progress=lambda d, n: ctx.emit(0, 1, message=f"sampled {d}/{n} questions"))
        if cfg.replay > 0:
            replayed = replay_samples(cfg, base, tokenizer, round(cfg.replay * len(samples)))
            samples, stats = samples + replayed, {**stats, "replayed": len(replayed)}
        return samples, stats

    samples, stats = kept_trajectories(ctx, "rft_data.pt", sample)
    prm_version = stats.pop("prm_version", "")
    out = fit_and_publish(ctx, cfg, model, tokenizer, samples, stats, base=base, name=cfg.publish_name,
                          stage="rft", max_steps=cfg.max_train_steps)
    return {**out, "prm_version": prm_version} if out else out


register_stage("rft", RFTConfig, run_rft,
               description="PRM-guided rejection-sampling fine-tuning: sample through the policy, keep the correct "
                           "trajectories and fine-tune on the steps the PRM approves (filter=step, ProRAG's) or on "
                           "the trajectories whose every step it approves (filter=trajectory)",
               checks={"base_model": "model"})
