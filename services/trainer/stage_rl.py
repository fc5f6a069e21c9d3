"""Stage 4: process-supervised RL (ProRAG's dual-granularity GRPO) on LoRA adapters.

:func:`run_rl` runs each iteration as named steps, whose optimizer steps are those of the house training loop
(prorag.training.loop.TrainingLoop), so checkpoints, resume, stop and progress events are the loop's:

1. publish (services.trainer.rl_publish): the current LoRA adapter (version ``<job id>-<iteration>``) is saved,
   published into the world's adapter registry (the policy's adapter root) and pushed to every policy replica,
   which load and activate it (the last update's weights are published the same way when the job ends);
2. collect (services.trainer.rl_collect.roll_out): a batch of train questions is rolled out G times each through
   the policy service (live retrieval); every trajectory names the adapter version that produced it, and one
   older than ``max_policy_lag`` iterations (or from another adapter) is dropped;
3. score (rl_collect.score): the PRM service's logits for every step of the iteration, in one call; or, with
   step_scorer=oracle, the reference judge's verdict on the gold decomposition as a logit (a diagnostic ceiling:
   what a PRM that is always right would give);
4. advantages (rl_collect.advantages): outcome reward per trajectory (OUTCOME_REWARDS on token F1 and format),
   and per step the estimator ``advantage`` names (ADVANTAGE_ESTIMATORS; grpo: A = group_normalized(R) + beta *
   process advantage, the step score chosen by step_score, the PRM logits optionally centred per step kind, the
   group's sigma floored and the answer step optionally left out: prm_centering, process_std_floor,
   process_answer_step), broadcast to the step's generated tokens only;
5. update (services.trainer.rl_update): ``mini_batches`` optimizer steps of the loss ``policy_loss`` names
   (POLICY_LOSSES; clipped: the clipped surrogate) with the sampling log-probs the policy service returned as the
   old policy, recomputed log-probs from the local LoRA model, and an optional k3 KL to the base (the same model
   with the adapter disabled); then the iteration's journal row (services.trainer.rl_run).

Steps 1-4 talk to the services: on a launch of several processes the main process alone does them and hands the
data to the others (prorag.training.distributed.from_main), which all take part in step 5.

beta = 0 or prm = '' is outcome-only GRPO (the Search-R1-style baseline) through the same code. One update per
rollout batch (GRPO's mu = 1, as ProRAG's TRL setup): the ratio departs from 1 only by the lag between the
sampling and the training weights, which is what the clip bounds.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from prorag import paths
from prorag.data.loaders import load_split
from prorag.errors import FailedPrecondition
from prorag.modeling import load_for_training
from prorag.registry import ArtifactRef, registry, weights_sha256
from prorag.rpc.clients import PolicyClient, PRMClient
from prorag.training.context import JobContext
from prorag.training.distributed import from_main
from prorag.training.lora import build_lora
from prorag.training.loop import TrainingLoop
from services.trainer.rl_collect import ORACLE_LOGIT, ORACLE_SCORING_VERSION, collect, oracle_step_logits
from services.trainer.rl_config import RLConfig
from services.trainer.rl_publish import adapter_version, policy_lag, publish_and_push
from services.trainer.rl_run import (IterationData, RLRun, iteration_from_kept, journal_rows, keep_iteration,
                                     read_kept_iteration, record, trim_journal)
from services.trainer.rl_update import loop_config, policy_loss, recompute_old_logprobs, update
from services.trainer.sampling import select_questions
from services.trainer.stages import register_stage, resolve_model

#: bumped when what the PRM is asked to score changes (2, 3: empty and blank steps left out), so a caller that names
#: jobs by their settings (the pipeline) does not reuse a job that ran, or failed, under the old behaviour
PRM_SCORING_VERSION = 3

# what callers read from the stage by name (the pipeline, diagnostics, tests)
__all__ = ["ORACLE_LOGIT", "ORACLE_SCORING_VERSION", "PRM_SCORING_VERSION", "RLConfig", "adapter_version", "collect",
           "hop_balanced_draw", "oracle_step_logits", "policy_lag", "pool_questions", "pool_start_f1",
           "read_question_pool", "run_rl", "select_questions", "start_f1_mean"]


# ---------------------------------------------------------------- the questions
def pool_questions(questions: list, pool_ids) -> list:
    """The questions [Q] whose id is in ``pool_ids``, in the split's order (so the seeded draw over them is the
    same for every method that reads the same pool)."""
    wanted = set(pool_ids)
    return [q for q in questions if q.id in wanted]


def read_question_pool(path: str | Path, world: str, split: str, max_solve_rate: float = 1.0,
                       max_greedy_f1: float = 1.0) -> list[str]:
    """The learnable question ids of a pool artifact (services.trainer.stage_rlpool) whose solve rate (the
    fraction of the pool agent's samples that were right) is at most ``max_solve_rate`` and whose greedy answer's
    F1 is at most ``max_greedy_f1`` (1 = no bound on either); FailedPrecondition when the artifact is missing, was
    built on another world or split than the RL job samples, or lacks the figure a bound reads."""
    p = Path(path)
    if not p.is_file():
        raise FailedPrecondition(f"question_pool {str(path)!r} does not exist (run the rlpool stage first)")
    pool = json.loads(p.read_text())
    if (pool.get("world"), pool.get("split")) != (world, split):
        raise FailedPrecondition(f"question_pool {str(path)!r} was built on world {pool.get('world')!r}, split "
                                 f"{pool.get('split')!r}; this job samples world {world!r}, split {split!r}")
    rates = pool.get("questions", {})
    keep = list(pool["pool"])
    for key, what, bound, setting, rebuild in (
            ("solve_rate", "solve rate", max_solve_rate, "pool_max_solve_rate", "rebuild it with the rlpool stage"),
            ("greedy_f1", "greedy F1", max_greedy_f1, "pool_max_greedy_f1",
             "rebuild it with the rlpool stage's greedy=true")):
        if bound >= 1.0:
            continue
        lacking = [q for q in keep if key not in rates.get(q, {})]
        if lacking:
            raise FailedPrecondition(f"question_pool {str(path)!r} records no {what} for {len(lacking)} of its "
                                     f"questions (e.g. {lacking[0]!r}), so {setting} {bound} cannot select from it "
                                     f"({rebuild})")
        keep = [q for q in keep if rates[q][key] <= bound + 1e-9]
    return keep


def pool_start_f1(path: str | Path) -> dict[str, float]:
    """question id -> the mean F1 of the pool agent's samples on it, as a pool artifact (stage rlpool) records it
    ({} for an artifact without per-question figures)."""
    rates = json.loads(Path(path).read_text()).get("questions", {})
    return {q: float(r["f1_mean"]) for q, r in rates.items() if "f1_mean" in r}


def start_f1_mean(start_f1: dict[str, float], questions) -> float | None:
    """The start model's mean sampled F1 over ``questions`` [Q] (each question weighted once, as each group is),
    or None when the pool records none of them."""
    known = [start_f1[q.id] for q in questions if q.id in start_f1]
    return sum(known) / len(known) if known else None


def rl_questions(cfg: RLConfig) -> list:
    """The questions the job draws from: the split's, those of question_pool's learnable ones the settings keep,
    then min_hops and max_questions; FailedPrecondition when none is left, or when the oracle would judge a
    question without its gold decomposition."""
    qs = load_split(paths.world_dir(cfg.world), cfg.split)
    if cfg.question_pool:
        qs = pool_questions(qs, read_question_pool(cfg.question_pool, cfg.world, cfg.split, cfg.pool_max_solve_rate,
                                                   cfg.pool_max_greedy_f1))
    qs = select_questions(qs, cfg.min_hops, cfg.max_questions)
    if not qs:
        raise FailedPrecondition(f"world {cfg.world!r} has no {cfg.split} questions"
                                 + (f" of {cfg.min_hops}+ hops" if cfg.min_hops else "")
                                 + (f" in question_pool {cfg.question_pool!r}" if cfg.question_pool else "")
                                 + (f" solved at most {cfg.pool_max_solve_rate:.0%} of the time"
                                    if cfg.question_pool and cfg.pool_max_solve_rate < 1 else "")
                                 + (f" whose greedy answer scored at most F1 {cfg.pool_max_greedy_f1}"
                                    if cfg.question_pool and cfg.pool_max_greedy_f1 < 1 else ""))
    if cfg.step_scorer == "oracle" and cfg.beta > 0:
        lacking = [q.id for q in qs if not q.decomposition]
        if lacking:  # the oracle judges against the gold hops: without them every step would read as unsound
            raise FailedPrecondition(f"step_scorer=oracle needs each question's gold decomposition; {len(lacking)} "
                                     f"of the {cfg.split} questions have none (e.g. {lacking[0]!r})")
    return qs


# ---------------------------------------------------------------- the stage
def hop_balanced_draw(hops: Sequence[int], per_iteration: int, iteration: int, seed: int) -> list[int]:
    """Indices into the questions (``hops`` [Q]: each one's hop count) that iteration ``iteration`` rolls out: as
    many of each hop count as of the others (the larger hop counts take the remainder; a count with fewer questions
    than its share gives them all), each count's questions sliced from a seeded shuffle of its own per pass, so a
    count with fewer questions is revisited more often and no question comes twice in one iteration. A function of
    (seed, iteration) only, so a resumed job rolls out the same questions. Why: RL moved the agent's planned hop
    count toward the pool's most common one (docs/BENCHMARKS.md, "Where RL's new early answers come from").

    >>> draw = hop_balanced_draw([3, 3, 3, 3, 3, 3, 4, 4], per_iteration=4, iteration=0, seed=1)
    >>> sorted([3, 3, 3, 3, 3, 3, 4, 4][i] for i in draw), len(set(draw))
    ([3, 3, 4, 4], 4)
    """
    groups: dict[int, list[int]] = {}
    for i, h in enumerate(hops):
        groups.setdefault(int(h), []).append(i)
    counts = sorted(groups)
    out: list[int] = []
    for g, h in enumerate(counts):
        members = groups[h]
        share = per_iteration // len(counts) + (1 if len(counts) - 1 - g < per_iteration % len(counts) else 0)
        take = max(1, min(share, len(members)))
        epoch, j = divmod(iteration, len(members) // take)
        order = torch.randperm(len(members), generator=torch.Generator().manual_seed(seed * 1_000_003 + h * 10_007
                                                                                     + epoch))
        out += [members[int(x)] for x in order[j * take:(j + 1) * take]]
    return out


def questions_at(run: RLRun, iteration: int) -> list:
    """The questions iteration ``iteration`` rolls out: a slice of a seeded shuffle of the questions per epoch, or
    with balance_hops :func:`hop_balanced_draw`. The order is a function of (seed, epoch) only, so a resumed job
    rolls out the same questions."""
    cfg, qs = run.cfg, run.questions
    if cfg.balance_hops:
        return [qs[i] for i in hop_balanced_draw([q.hops for q in qs], cfg.questions_per_iteration, iteration,
                                                 cfg.seed)]
    epoch, j = divmod(iteration, run.per_epoch)
    order = torch.randperm(len(qs), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
    return [qs[int(x)] for x in order[j * cfg.questions_per_iteration:(j + 1) * cfg.questions_per_iteration]]


def start_run(ctx: JobContext) -> RLRun:
    """The job's questions, the LoRA model over the frozen base and, on the main process, the service clients."""
    cfg: RLConfig = ctx.config
    cfg.apply_threads()
    placement = cfg.placement()
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    base_sha = weights_sha256(base)
    qs = rl_questions(cfg)
    ctx.seed_everything(cfg.seed)
    # the base is frozen under the adapter: stored in the compute dtype, the LoRA weights in float32
    model, tokenizer = load_for_training(base, placement, frozen=True,
                                         gradient_checkpointing=cfg.gradient_checkpointing)
    run = RLRun(ctx, qs, build_lora(model, cfg), tokenizer, placement, base, base_sha,
                start_f1=pool_start_f1(cfg.question_pool) if cfg.question_pool else {})
    # On a launch of several processes every process trains on each iteration's rollouts, but only the main one
    # talks to the services (publishes, pushes, rolls out, asks the PRM) and keeps the journal.
    if ctx.is_main:
        run.policy = PolicyClient(cfg.policy, timeout=3600)
        if cfg.step_scorer == "prm" and cfg.prm and cfg.beta > 0:
            run.prm = PRMClient(cfg.prm, timeout=600)
    return run


def iteration_data(run: RLRun, iteration: int) -> tuple[str, dict, IterationData]:
    """Steps 1-4: publish and push the weights as they are, then collect the iteration's data with them (roll out,
    score, advantages: the main process, handed to the others). An iteration a stop cut short after its first
    mini-batch is not collected again: its kept data is read back."""
    blob = from_main(run.acc, partial(read_kept_iteration, run, iteration))
    if blob is not None:
        return iteration_from_kept(blob)
    cfg, ctx = run.cfg, run.ctx
    version, push = publish_and_push(run, iteration)
    questions = questions_at(run, iteration)
    data = from_main(run.acc, partial(collect, cfg, questions, iteration, ctx.job_id,
                                      f"{cfg.adapter_name}@{version}", run.policy, run.prm))
    start = start_f1_mean(run.start_f1, questions)
    if start is not None:  # the same questions' F1 under the start model: a rise over it is learning, not the draw
        data.stats["start_f1_mean"] = start
    if cfg.recompute_old_logprobs and data.samples:
        recompute_old_logprobs(run, data.samples)
    keep_iteration(run, iteration, version, push, data)
    return version, push, data


def train(run: RLRun) -> bool:
    """The iterations left (a resumed job starts after its checkpoint's): publish, collect, score, advantages,
    update, journal row. False when the job stops part-way (the loop saved its checkpoint)."""
    loop = run.loop
    first = loop.step // run.cfg.mini_batches
    if run.ctx.is_main:
        trim_journal(run.journal, first)
    for iteration in range(first, run.total):
        if loop.stop_requested():
            return False
        version, push, data = iteration_data(run, iteration)
        done = update(run, iteration, data)
        if done is None:
            return False
        record(run, iteration, version, push, data.stats, done)
        # after the row: checkpoints fall on iteration boundaries (checkpoint_every counts iterations), so
        # a resumed job never lacks the row of an iteration its weights have seen
        loop.save_if_due()
    return True


def run_rl(ctx: JobContext) -> dict:
    run = start_run(ctx)
    try:
        # the loop restores a resumed job's checkpoint: ``loop.step`` optimizer steps are done
        with TrainingLoop(ctx, run.model, partial(policy_loss, run), loop_config(run),
                          placement=run.placement) as run.loop:
            if not train(run):
                return {}
            final_loss = run.loop.loss
        # the last update's weights (each iteration's own are published as the next one starts)
        version, push = publish_and_push(run, run.total)
    finally:
        run.close()
    if not ctx.is_main:  # the other processes of a launch publish nothing
        return {}
    return summary(run, version, push, final_loss)


def summary(run: RLRun, version: str, push: dict, final_loss: float) -> dict:
    """The job's outputs: the last adapter, the journal as an artifact and totals over its rows."""
    cfg, ctx = run.cfg, run.ctx
    rows = journal_rows(run.journal)
    with ctx.artifact_file("iterations", "iterations.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = ArtifactRef(cfg.adapter_name, version)
    out = {"adapter": ref.key, "iterations": run.total, "final_loss": final_loss,
           "push_acked": push["push_acked"], "push_acks": push["push_acks"],
           "adapter_path": str(registry("adapter", cfg.world).path(ref))}
    for key in ("sampled", "kept", "dropped_stale", "dropped_foreign", "dropped_too_long", "trained_tokens"):
        out[f"total_{key}"] = float(sum(r.get(key, 0) for r in rows))
    if rows:
        for key in ("reward_mean", "f1_mean", "format_valid_rate", "clip_fraction", "approx_kl", "lag_mean"):
            out[f"last_{key}"] = float(rows[-1].get(key, 0.0))
        out["lag_max"] = max(float(r.get("lag_max", 0.0)) for r in rows)
        # groups whose rollouts all earned the same reward: no outcome signal (what a learnable pool cuts down)
        out["groups_flat_fraction"] = (sum(float(r.get("groups_flat", 0)) for r in rows)
                                       / max(1.0, sum(float(r.get("groups", 0)) for r in rows)))
    out["questions_drawn_from"] = float(len(run.questions))
    return out


register_stage("rl", RLConfig, run_rl,
               description="process-supervised GRPO on LoRA adapters: rollouts through the policy, step scores from "
                           "the PRM, a new adapter version published and pushed to every replica each iteration "
                           "(beta=0 or prm='' = outcome-only GRPO)",
               checks={"base_model": "model", "adapter_name": "name", "question_pool": "path"})
