"""One RL job's state as its steps read it (:class:`RLRun`, :class:`IterationData`), and what a stopped or killed
job leaves for its resume beside the loop's checkpoints: the journal of finished iterations and the data of an
iteration cut short."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from prorag.io import atomic_path
from prorag.training.checkpoint import load_weights_file
from prorag.training.context import JobContext
from prorag.training.lora import RLSample
from services.trainer.rl_config import RLConfig


@dataclass
class IterationData:
    """What one iteration trains on: its samples (trajectories with per-token advantages) and journal numbers."""

    samples: list[RLSample] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


@dataclass
class RLRun:
    """The job, its questions, the LoRA model being trained and the service clients. On a launch of several
    processes only the main one holds clients (it publishes, rolls out and asks the PRM); the others get each
    iteration's data from it."""

    ctx: JobContext
    questions: list
    model: Any
    tokenizer: Any
    placement: Any
    base: Path
    base_sha: str
    policy: Any = None  # PolicyClient on the main process
    prm: Any = None  # PRMClient on the main process when the PRM scores steps
    loop: Any = None  # the TrainingLoop, once entered
    #: question id -> the start model's mean sampled F1 on it, from question_pool (empty without one): what each
    #: iteration's rollouts are read against, the same questions before any update. Where the pool was filtered by
    #: these same samples (pool_max_solve_rate) they read low (regression to the mean); iteration 0, rolled out
    #: before any update, measures that offset
    start_f1: dict = field(default_factory=dict)

    @property
    def cfg(self) -> RLConfig:
        return self.ctx.config

    @property
    def acc(self):
        return self.ctx.accelerator

    @property
    def per_epoch(self) -> int:
        return math.ceil(len(self.questions) / self.cfg.questions_per_iteration)

    @property
    def total(self) -> int:
        """Iterations of the job: cfg.iterations, or one pass over the questions."""
        return self.cfg.iterations or self.per_epoch

    @property
    def journal(self) -> Path:
        return self.ctx.checkpoint_dir / "rl-iterations.jsonl"

    def close(self) -> None:
        for client in (self.policy, self.prm):
            if client is not None:
                client.close()


# ---------------------------------------------------------------- the journal
def record(run: RLRun, iteration: int, version: str, push: dict, stats: dict, done: dict) -> None:
    """The iteration's journal row, metrics and progress message (the main process)."""
    ctx, cfg = run.ctx, run.cfg
    if not ctx.is_main:
        return
    numbers = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    row = {**numbers, **{k: v for k, v in push.items() if k != "acks"}, **done}
    ctx.log_metrics(iteration + 1, row)
    with open(run.journal, "a") as f:
        f.write(json.dumps({"iteration": iteration, "adapter": f"{cfg.adapter_name}@{version}",
                            "acks": push["acks"], "prm_version": stats.get("prm_version", ""), **row}) + "\n")
    ctx.emit(iteration + 1, run.total, message=f"iteration {iteration + 1}/{run.total}: kept {numbers['kept']}/"
                                               f"{numbers['sampled']}, reward {numbers['reward_mean']:.3f}, "
                                               f"F1 {numbers['f1_mean']:.3f}, stale {numbers['dropped_stale']}")


def trim_journal(journal: Path, iterations: int) -> None:
    """Drop the journal's rows of iterations >= ``iterations``: a killed job may have written rows its last
    checkpoint's weights have not seen; the resumed job runs those iterations again."""
    if journal.exists():
        keep = [line for line in journal.read_text().splitlines() if json.loads(line)["iteration"] < iterations]
        journal.write_text("".join(line + "\n" for line in keep))


def journal_rows(journal: Path) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


# ---------------------------------------------------------------- an iteration cut short
# With several mini-batches a stop can land inside an iteration, after the weights that sampled it have changed:
# its data is kept with the checkpoints, so the resumed job trains on the same trajectories rather than new ones.
def _kept_path(run: RLRun, iteration: int) -> Path:
    return run.ctx.checkpoint_dir / f"rl-iteration-{iteration}.pt"


def read_kept_iteration(run: RLRun, iteration: int) -> dict | None:
    """The kept data of ``iteration`` ({version, push, stats, samples}), None when there is none."""
    saved = _kept_path(run, iteration)
    if run.cfg.mini_batches > 1 and saved.exists():
        return load_weights_file(saved)
    return None


def iteration_from_kept(blob: dict) -> tuple[str, dict, IterationData]:
    return blob["version"], blob["push"], IterationData([RLSample(**d) for d in blob["samples"]], blob["stats"])


def keep_iteration(run: RLRun, iteration: int, version: str, push: dict, data: IterationData) -> None:
    """Keep the iteration's data for a resume inside it (the main process, with several mini-batches); the
    previous iteration's is removed."""
    if run.cfg.mini_batches <= 1 or not run.ctx.is_main:
        return
    for old in run.ctx.checkpoint_dir.glob("rl-iteration-*.pt"):
        old.unlink()
    with atomic_path(_kept_path(run, iteration)) as tmp:
        torch.save({"version": version, "push": push, "stats": data.stats,
                    "samples": [asdict(x) for x in data.samples]}, tmp)
