"""The context a training stage runs with: config, directories, progress events, checkpoints, artifacts.

The trainer service builds one per job (services.trainer.jobs); :func:`local_context` builds one for
running a stage function in this process without the service (the embedded base's warm-up), with
the same checkpoints, so a killed in-process run resumes from its last checkpoint too. The contract
a resumable stage follows is written at the top of services/trainer/stages.py;
prorag.training.loop implements it for every gradient-descent stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from prorag import paths
from prorag.config import to_dict
from prorag.errors import FailedPrecondition
from prorag.io import atomic_dir, atomic_path, sha256_file, write_text

log = logging.getLogger("prorag.training.context")


class StageStopped(Exception):
    """Raised by ``JobContext.check_stop()``: the job was cancelled or the trainer is stopping."""


# ---------------------------------------------------------------- manifests of finished runs
def manifest_path(value: str) -> Path:
    """A run's manifest.json from its path, its run dir, or either relative to PRORAG_HOME."""
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = paths.home() / p
    return p / "manifest.json" if p.is_dir() or p.name != "manifest.json" else p


def load_manifest(path: str | Path) -> dict:
    """A run's manifest with each artifact's ``abs_path`` (manifests store paths relative to the run dir)."""
    path = manifest_path(str(path))
    data = json.loads(path.read_text())
    for art in data.get("artifacts", []):
        art["abs_path"] = str((path.parent / art["path"]).resolve())
    return data


def artifact_path(manifest: str | Path, name: str) -> Path:
    for art in load_manifest(manifest).get("artifacts", []):
        if art["name"] == name:
            return Path(art["abs_path"])
    raise FailedPrecondition(f"run {manifest} has no artifact {name!r}")


def sha256_tree(path: str | Path) -> str:
    """sha256 of a file, or of a directory as sorted (relative path, file digest) pairs."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(p).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the context
class JobContext:
    """What a running stage sees: its config, directories, progress events, checkpoints, artifacts."""

    def __init__(self, *, job_id: str, stage: str, config: Any, run_dir: Path, checkpoint_dir: Path,
                 inputs: dict[str, dict], emit_fn: Callable[[dict], None], artifact_fn: Callable[[dict], None],
                 cancel_event: threading.Event, stop_event: threading.Event, tracker: Any = None,
                 keep_checkpoints: int = 2, total_steps: int = 0):
        self.job_id = job_id
        self.stage = stage
        self.config = config
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.inputs = {k: Path(v["path"]) for k, v in inputs.items()}
        self.keep_checkpoints = keep_checkpoints
        self.log = logging.getLogger(f"prorag.trainer.job.{stage}")
        self.resumed_from_step: int | None = None
        self._emit_fn = emit_fn
        self._artifact_fn = artifact_fn
        self._cancel = cancel_event
        self._stop = stop_event
        self._tracker = tracker
        self._origin: tuple[float, int] | None = None  # (time, step) the rate is measured from
        self._total = total_steps  # known from an earlier attempt; updated by every emit()
        # set by a multi-process launch (services/trainer/launch.py); run_loop then splits each step over the
        # processes, and a stage publishes only from the main one (is_main)
        self.accelerator: Any = None
        # a non-main process of a launch resumes from the main process's checkpoints (read only)
        self.shared_checkpoint_dir: Path | None = None

    @property
    def is_main(self) -> bool:
        """Whether this process writes the job's outputs: always, unless it is a non-main process of a launch."""
        return self.accelerator is None or bool(self.accelerator.is_main_process)

    @property
    def config_dict(self) -> dict:
        return to_dict(self.config)

    # -- control
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def should_stop(self) -> bool:
        """True once the job is cancelled or the trainer is shutting down: return at the next step."""
        return self._cancel.is_set() or self._stop.is_set()

    def check_stop(self) -> None:
        if self.should_stop():
            raise StageStopped("cancelled" if self.cancelled() else "trainer is stopping")

    @staticmethod
    def seed_everything(seed: int) -> None:
        import torch

        random.seed(seed)
        np.random.seed(seed % (2 ** 32))
        torch.manual_seed(seed)

    # -- progress
    def emit(self, step: int, total_steps: int, loss: float | None = None, tokens_per_s: float | None = None,
             message: str = "", metrics: dict | None = None, artifacts: list[dict] | None = None) -> None:
        """A progress event (eta from the step rate since this attempt began) and a metrics row."""
        now = time.monotonic()
        self._total = total_steps
        if self._origin is None or step < self._origin[1]:
            self._origin = (now, step)
        t0, s0 = self._origin
        eta = None
        if total_steps and step > s0 and now > t0:
            eta = max(0.0, (total_steps - step) * (now - t0) / (step - s0))
        row = dict(metrics or {})
        if loss is not None:
            row["loss"] = float(loss)
        if tokens_per_s is not None:
            row["tokens_per_s"] = float(tokens_per_s)
        if self._tracker is not None and row:
            self._tracker.log(step, row)
        self._emit_fn({"step": int(step), "total_steps": int(total_steps), "loss": loss, "tokens_per_s": tokens_per_s,
                       "eta_s": eta, "message": message, "metrics": metrics or {}, "artifacts": artifacts or []})

    def log_metrics(self, step: int, metrics: dict) -> None:
        """A metrics row without a progress event (e.g. per-step values between events)."""
        if self._tracker is not None:
            self._tracker.log(step, metrics)

    # -- checkpoints
    def save_checkpoint(self, state: dict, step: int | None = None) -> Path:
        from prorag.training import checkpoint

        if step is None:
            if "step" not in state:
                raise ValueError("save_checkpoint needs the step: put it in state['step'] or pass step=")
            step = int(state["step"])
        path = checkpoint.save(self.checkpoint_dir, state, step, keep=self.keep_checkpoints)
        self._emit_fn({"step": step, "total_steps": self._total, "message": f"checkpoint saved at step {step}",
                       "checkpoint_step": step})
        return path

    def load_checkpoint(self, restore_rng: bool = True) -> dict | None:
        """The latest checkpoint's state (RNG states restored), or None on a fresh start."""
        from prorag.training import checkpoint

        shared = self.shared_checkpoint_dir
        if shared is None:  # only the writer of a checkpoint directory may clear what a killed writer left
            checkpoint.cleanup_temp(self.checkpoint_dir)
        found = checkpoint.load_latest(shared or self.checkpoint_dir)
        if found is None:
            if self._tracker is not None:
                self._tracker.rewind(0)  # an attempt killed before its first checkpoint starts over
            return None
        state, path = found
        if restore_rng and "rng" in state:
            checkpoint.restore_rng(state["rng"])
        step = int(state["step"])
        self.resumed_from_step = step
        if self._tracker is not None:
            self._tracker.rewind(step)
        self._origin = (time.monotonic(), step)
        self._emit_fn({"step": step, "total_steps": self._total, "message": f"resumed from step {step}",
                       "resumed_from_step": step})
        return state

    # -- checkpoints of a launch on several processes (every process calls these at the same point)
    @property
    def job_checkpoint_dir(self) -> Path:
        """The job's checkpoint directory: a non-main process of a launch shares the main process's."""
        return self.shared_checkpoint_dir or self.checkpoint_dir

    def save_launch_checkpoint(self, accelerator, state: dict, step: int) -> Path:
        """Every process of a launch: the model, optimizer and RNG states through accelerate, plus ``state`` (the
        loop's own part), as the checkpoint of ``step`` (prorag.training.checkpoint.save_launch); the main process
        reports it."""
        from prorag.training import checkpoint

        path = checkpoint.save_launch(self.job_checkpoint_dir, accelerator, state, step, keep=self.keep_checkpoints)
        if accelerator.is_main_process:
            self._emit_fn({"step": step, "total_steps": self._total, "message": f"checkpoint saved at step {step}",
                           "checkpoint_step": step})
        return path

    def load_launch_checkpoint(self, accelerator) -> dict | None:
        """Every process of a launch: the newest checkpoint restored into the prepared model and optimizer and
        this process's RNG states; returns the loop's own part (with "step"), or None on a fresh start."""
        from prorag.training import checkpoint

        found = checkpoint.load_latest_launch(self.job_checkpoint_dir, accelerator)
        if found is None:
            if self._tracker is not None:
                self._tracker.rewind(0)
            return None
        state, _ = found
        step = int(state["step"])
        self.resumed_from_step = step
        if self._tracker is not None:
            self._tracker.rewind(step)
        self._origin = (time.monotonic(), step)
        if accelerator.is_main_process:
            self._emit_fn({"step": step, "total_steps": self._total, "message": f"resumed from step {step}",
                           "resumed_from_step": step})
        return state

    # -- artifacts
    def write_artifact(self, name: str, path: str | Path) -> dict:
        """Register a complete file or directory as an artifact (copied in atomically if outside the run dir)."""
        p = Path(path)
        if not p.is_absolute():
            p = self.run_dir / p
        if not p.exists():
            raise FileNotFoundError(f"artifact {name!r}: {p} does not exist")
        run = self.run_dir.resolve()
        if run not in p.resolve().parents:
            dest = self.run_dir / p.name
            if p.is_dir():
                with atomic_dir(dest) as tmp:
                    shutil.copytree(p, tmp, dirs_exist_ok=True)
            else:
                with atomic_path(dest) as tmp:
                    shutil.copyfile(p, tmp)
            p = dest
        art = {"name": name, "path": p.resolve().relative_to(run).as_posix(), "sha256": sha256_tree(p)}
        self._artifact_fn(art)
        return art

    @contextlib.contextmanager
    def artifact_file(self, name: str, filename: str | None = None) -> Iterator[Path]:
        """Yield a temp path; when the block succeeds it becomes ``run_dir/filename`` and is registered."""
        dest = self.run_dir / (filename or name)
        with atomic_path(dest) as tmp:
            yield tmp
        self.write_artifact(name, dest)

    @contextlib.contextmanager
    def artifact_dir(self, name: str, dirname: str | None = None) -> Iterator[Path]:
        """Like artifact_file for a directory (e.g. ``save_pretrained``)."""
        dest = self.run_dir / (dirname or name)
        with atomic_dir(dest) as tmp:
            yield tmp
        self.write_artifact(name, dest)

    def input_manifest(self, name: str) -> dict:
        return load_manifest(self.inputs[name])

    def input_artifact(self, input_name: str, artifact_name: str) -> Path:
        return artifact_path(self.inputs[input_name], artifact_name)


# ---------------------------------------------------------------- running a stage in this process
def _log_event(event: dict) -> None:
    if event.get("loss") is not None:
        log.info("step %d/%d loss %.4f tokens/s %.0f MFU %.2f%%", event["step"], event["total_steps"], event["loss"],
                 event.get("tokens_per_s") or 0.0, 100 * event["metrics"].get("mfu", 0.0))
    elif event.get("message"):
        log.info("%s", event["message"])


def local_context(work_dir: str | Path, config: Any, emit: Callable[[dict], None] | None = None, *,
                  stage: str = "local", cancel: threading.Event | None = None,
                  stop: threading.Event | None = None, keep_checkpoints: int = 2) -> JobContext:
    """A JobContext for calling a stage function in this process: checkpoints under
    ``work_dir/checkpoints``, artifacts under ``work_dir/run``, events to ``emit(event)`` (default: the log).

    Called again with the same work_dir and config after a kill, the stage resumes from its last
    checkpoint. A different config clears the checkpoints first: resuming another config's weights
    would silently train the wrong thing. cancel / stop mean what they mean in the trainer: give up
    (no checkpoint) / checkpoint and return so a later call resumes.
    """
    # absolute: write_artifact reads a relative path as one inside the run dir, so a relative run dir joined twice
    work = Path(work_dir).resolve()
    checkpoints = work / "checkpoints"
    identity = json.dumps(to_dict(config), sort_keys=True, default=str)
    stamp = work / "config.json"
    if stamp.exists() and stamp.read_text() != identity:
        shutil.rmtree(checkpoints, ignore_errors=True)
    write_text(stamp, identity)
    (work / "run").mkdir(parents=True, exist_ok=True)
    return JobContext(job_id=work.name, stage=stage, config=config, run_dir=work / "run", checkpoint_dir=checkpoints,
                      inputs={}, emit_fn=emit or _log_event, artifact_fn=lambda art: None,
                      cancel_event=cancel or threading.Event(), stop_event=stop or threading.Event(),
                      keep_checkpoints=keep_checkpoints)


__all__ = ["JobContext", "StageStopped", "local_context", "load_manifest", "artifact_path", "manifest_path",
           "sha256_tree"]
