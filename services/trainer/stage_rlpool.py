"""A learnable question pool for RL (issue 30 deliverable 4): the questions on which the start model's samples are
neither all right nor all wrong.

GRPO learns only from groups whose rollouts earn different rewards; a question the start model always or never
answers gives a group with no outcome signal. This stage samples ``samples`` rollouts of each candidate train
question from the policy service serving the start model (the same Rollout call and sampling settings as the RL
stage), scores each with the RL's outcome reward and token F1 (a sample is right when its F1 reaches ``min_f1``,
by default the F1 from which the reward gives answer credit), and writes ``pool.json``: the learnable question ids
(:func:`learnable`), every candidate's solve rate and hop count, and the counts (candidates, all right, all wrong,
learnable; overall and by hop count: :func:`pool_counts`). Every RL method then draws from the same pool
(RLConfig.question_pool).

Each finished Rollout request appends one fsynced line to a journal in the checkpoint directory, so a stopped or
killed job resumes with the requests it had not finished (each request's sampling seed is a function of its place
in the candidate list, so a resumed job samples what an uninterrupted one would).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prorag import paths
from prorag.algorithms.rl import ANSWER_CREDIT_F1, OUTCOME_REWARDS
from prorag.config import ConfigError, cfg_field
from prorag.data.loaders import load_split
from prorag.data.world.config import RL_SPLITS, TEST_SPLITS
from prorag.errors import FailedPrecondition
from prorag.io import append_jsonl_synced, read_jsonl_journal
from prorag.rpc.clients import PolicyClient
from prorag.training.context import JobContext
from services.trainer.sampling import (answer_f1, rollout, rollout_index_field, rollout_seed, rollout_topk_field,
                                      select_questions, step_tokens_field)
from services.trainer.stages import register_stage, resolve_model

#: bumped when what makes a question learnable changes, so a caller that names jobs by settings does not reuse
#: a pool built under the old rule
POOL_VERSION = 1


@dataclass
class RLPoolConfig:
    """Sample the start model on candidate train questions; keep those it sometimes, but not always, gets right."""

    world: str = cfg_field("default", help="embedded world whose questions are sampled")
    split: str = cfg_field("train", help="split whose questions are candidates (never the test split)")
    max_questions: int = cfg_field(0, help="candidates, the split's first ones after min_hops (0 = all): as the "
                                           "RL stage's max_questions", min=0)
    min_hops: int = cfg_field(0, help="only candidates of at least this many hops (0 = all): as the RL stage's "
                                      "min_hops", min=0, max=16)
    policy: str = cfg_field("127.0.0.1:50052", help="policy service serving the start model")
    policy_model: str = cfg_field("", help="required: the start model the policy serves (a directory or "
                                           "name@version in the world's registry); the pool is this model's")
    adapter: str = cfg_field("", help="policy adapter name@version the samples must come from ('' = the served "
                                      "model itself: a sample from any adapter fails the job)")
    retriever_index: str = rollout_index_field()
    topk: int = rollout_topk_field()
    samples: int = cfg_field(8, help="rollouts per candidate question (as the RL's group size)", min=2, max=64)
    greedy: bool = cfg_field(False, help="also one greedy rollout per candidate (temperature 0), its answer's F1 "
                                         "recorded as greedy_f1: what the RL's pool_max_greedy_f1 selects on (a "
                                         "question whose samples are sometimes right may still have a right greedy "
                                         "answer, which RL can only sharpen)")
    temperature: float = cfg_field(1.0, help="sampling temperature (as the RL's)", min=0.01, max=5.0)
    max_step_tokens: int = step_tokens_field()
    max_steps: int = cfg_field(11, help="steps of a trajectory at most (as the RL's)", min=1, max=64)
    questions_per_request: int = cfg_field(32, help="questions in one Rollout request (one journal line)", min=1,
                                           max=4096)
    reward: str = cfg_field("reference", help="outcome reward recorded per question (as the RL's)",
                            choices=tuple(OUTCOME_REWARDS))
    min_f1: float = cfg_field(ANSWER_CREDIT_F1, help="a sample is right when its answer's token F1 reaches this "
                                                     "(default: the F1 from which the RL's reward gives answer "
                                                     "credit)", min=0.0, max=1.0)
    seed: int = cfg_field(0, help="base of the sampling seeds", min=0, max=2 ** 31 - 1)
    service_wait_s: float = cfg_field(300.0, help="how long a Rollout call waits, in all, for a policy service that "
                                                  "went away to come back before the job fails", min=0.0)
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default", choices=("", "wandb", "local"))

    def validate(self) -> None:
        if not self.policy_model:
            raise ConfigError("policy_model", "required: the start model the policy serves")
        if self.split in TEST_SPLITS:
            raise ConfigError("split", f"the RL question pool never draws on {self.split!r}: the final figures are "
                                       f"read on it (draw on 'train' or one of {list(RL_SPLITS)})")


# ---------------------------------------------------------------- pure parts
def learnable(correct: Sequence[bool]) -> bool:
    """Whether a question belongs in the pool: some of its samples [n] are right and some wrong (0 < right < n).

    >>> learnable([True, False, False]), learnable([True, True]), learnable([False, False]), learnable([])
    (True, False, False, False)
    """
    right = sum(bool(c) for c in correct)
    return 0 < right < len(correct)


def pool_counts(rows: Sequence[dict]) -> dict:
    """Counts over candidate rows [Q] (each {"hops": int, "correct": [n] bools}): candidates, all_right, all_wrong
    and learnable, overall and under "by_hops" keyed by the hop count as a string.

    >>> c = pool_counts([{"hops": 2, "correct": [True, False]}, {"hops": 3, "correct": [False, False]}])
    >>> c["learnable"], c["all_wrong"], c["by_hops"]["3"]
    (1, 1, {'candidates': 1, 'all_right': 0, 'all_wrong': 1, 'learnable': 0})
    """
    def count(part: Sequence[dict]) -> dict:
        return {"candidates": len(part),
                "all_right": sum(1 for r in part if r["correct"] and all(r["correct"])),
                "all_wrong": sum(1 for r in part if not any(r["correct"])),
                "learnable": sum(1 for r in part if learnable(r["correct"]))}

    hops = sorted({int(r["hops"]) for r in rows})
    return {**count(rows), "by_hops": {str(h): count([r for r in rows if int(r["hops"]) == h]) for h in hops}}


# ---------------------------------------------------------------- the journal
def _read_journal(path: Path) -> dict[int, list[dict]]:
    # one row per finished Rollout request (append_jsonl_synced): what a resumed job skips; a request whose line a
    # kill tore is sampled again
    return {int(row["request"]): row["rows"] for row in read_jsonl_journal(path)}


# ---------------------------------------------------------------- the stage
def sample_request(cfg: RLPoolConfig, policy, chunk: list, start: int, stats: dict) -> list[dict]:
    """One Rollout request: ``chunk`` [q] questions, ``samples`` rollouts each (and one greedy when cfg.greedy);
    returns one row per question {"id", "hops", "f1" [n], "reward" [n], "correct" [n]} (and "greedy_f1")."""
    reward_fn = OUTCOME_REWARDS[cfg.reward]
    by_id = {q.id: q for q in chunk}
    rows = {q.id: {"id": q.id, "hops": int(q.hops), "f1": [], "reward": [], "correct": []} for q in chunk}

    def start_model_rollouts(settings, n: int) -> list:
        # the RL stage's seed at iteration 0, by the request's place in the candidate list
        got = rollout(policy, settings, chunk, n, rollout_seed(cfg.seed, start), cfg.adapter, stats)
        for t in got:
            if t.adapter_version != cfg.adapter:
                # a pool is the start model's: samples from an RL adapter the policy still serves would mislabel it
                raise FailedPrecondition(f"the policy at {cfg.policy} sampled with adapter {t.adapter_version!r}, "
                                         f"not {cfg.adapter or 'the served model itself'!r}: serve the start model "
                                         "(no active adapter) or name the adapter")
        return got

    if cfg.greedy:  # temperature 0: the policy decodes greedily, as the evaluations do
        for t in start_model_rollouts(dataclasses.replace(cfg, temperature=0.0), 1):
            rows[t.question_id]["greedy_f1"] = round(answer_f1(t, by_id[t.question_id].golden_answers), 6)
    for t in start_model_rollouts(cfg, cfg.samples):
        f1 = answer_f1(t, by_id[t.question_id].golden_answers)
        row = rows[t.question_id]
        row["f1"].append(round(f1, 6))
        row["reward"].append(reward_fn(f1, bool(t.format_valid)))
        row["correct"].append(f1 >= cfg.min_f1)
        stats["sampled"] += 1
    return [rows[q.id] for q in chunk]


def run_rlpool(ctx: JobContext) -> dict:
    cfg: RLPoolConfig = ctx.config
    resolve_model(cfg.world, cfg.policy_model, "policy_model")  # the pool's model must exist
    qs = select_questions(load_split(paths.world_dir(cfg.world), cfg.split), cfg.min_hops, cfg.max_questions)
    if not qs:
        raise FailedPrecondition(f"world {cfg.world!r} has no {cfg.split} questions"
                                 + (f" of {cfg.min_hops}+ hops" if cfg.min_hops else ""))
    starts = list(range(0, len(qs), cfg.questions_per_request))
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    journal = ctx.checkpoint_dir / "rlpool-journal.jsonl"
    done = _read_journal(journal)
    todo = [k for k in range(len(starts)) if k not in done]
    answered = lambda: sum(len(r) for r in done.values())
    ctx.emit(answered(), len(qs), message=f"{len(qs)} candidate questions x {cfg.samples} samples, "
                                          f"{answered()} already sampled")
    stats = {"sampled": 0, "service_retries": 0}
    t0 = time.monotonic()
    with PolicyClient(cfg.policy, timeout=3600) as policy:
        for k in todo:
            if ctx.should_stop():
                return {}  # stopped, not done: the journal keeps what was sampled
            start = starts[k]
            rows = sample_request(cfg, policy, qs[start:start + cfg.questions_per_request], start, stats)
            append_jsonl_synced(journal, {"request": k, "rows": rows})
            done[k] = rows
            ctx.emit(answered(), len(qs), message="")
    rows = [r for k in range(len(starts)) for r in done[k]]
    counts = pool_counts(rows)
    pool = [r["id"] for r in rows if learnable(r["correct"])]
    artifact = {"version": POOL_VERSION, "world": cfg.world, "split": cfg.split, "policy_model": cfg.policy_model,
                "adapter": cfg.adapter, "samples": cfg.samples, "greedy": cfg.greedy, "min_f1": cfg.min_f1,
                "min_hops": cfg.min_hops,
                "max_questions": cfg.max_questions, "counts": counts, "pool": pool,
                "questions": {r["id"]: {"hops": r["hops"], "solve_rate": sum(r["correct"]) / max(1, len(r["correct"])),
                                        "samples": len(r["correct"]),
                                        "reward_mean": sum(r["reward"]) / max(1, len(r["reward"])),
                                        "f1_mean": sum(r["f1"]) / max(1, len(r["f1"])),
                                        **({"greedy_f1": r["greedy_f1"]} if "greedy_f1" in r else {})}
                                    for r in rows}}
    with ctx.artifact_file("pool", "pool.json") as tmp:
        tmp.write_text(json.dumps(artifact, indent=1))
    ctx.emit(len(qs), len(qs), message=f"{counts['learnable']} of {counts['candidates']} questions learnable "
                                       f"({counts['all_right']} all right, {counts['all_wrong']} all wrong)")
    out = {key: float(counts[key]) for key in ("candidates", "all_right", "all_wrong", "learnable")}
    for h, c in counts["by_hops"].items():
        out[f"learnable_hops_{h}"] = float(c["learnable"])
    if cfg.greedy:  # how many learnable questions greedy decoding does not already answer in full
        greedy = {r["id"]: r["greedy_f1"] for r in rows}
        out["greedy_f1_mean"] = sum(greedy.values()) / max(1, len(greedy))
        out["learnable_greedy_imperfect"] = float(sum(1 for q in pool if greedy[q] < 1.0))
    out["sampled_this_attempt"] = float(stats["sampled"])
    out["sample_s"] = time.monotonic() - t0
    out["pool_path"] = str(ctx.run_dir / "pool.json")
    return out


register_stage("rlpool", RLPoolConfig, run_rlpool,
               description="a learnable RL question pool: the start model's samples per train question through the "
                           "policy, questions neither always nor never answered right (pool.json)",
               checks={"policy_model": "model"})
