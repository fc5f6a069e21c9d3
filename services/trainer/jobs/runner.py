"""Running one job in a worker thread: its context, tracking and log file, its progress into its record, and
its end (manifest, final state)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from prorag.runs import code_version
from prorag.training.context import JobContext, sha256_tree
from services.trainer.jobs.admission import Admission
from services.trainer.jobs.ledger import JobLedger
from services.trainer.jobs.record import Artifact, Job, JobState, now_iso, numeric
from services.trainer.stages import Stage, get_stage, resolve_inputs, validate_config
from services.trainer.tracking import Tracker

log = logging.getLogger("prorag.trainer.jobs")


class JobRunner:
    """Runs a queued job's stage in the calling thread, recording what happens in the ledger."""

    def __init__(self, ledger: JobLedger, admission: Admission, stop: threading.Event, *, keep_checkpoints: int,
                 tracking: str, requeue_on_failure: Callable[[Job, str], bool] | None = None):
        """requeue_on_failure(job, error): asked, lock held, before a stage's failure is recorded; True = the
        caller has put the job back in QUEUED (a newer submission moved its services), so it does not fail."""
        self.ledger = ledger
        self.requeue_on_failure = requeue_on_failure
        self.admission = admission
        self.stop = stop  # the trainer is stopping: the stage checkpoints and the job resumes at the next start
        self.keep_checkpoints = keep_checkpoints
        self.tracking = tracking

    def run(self, job_id: str, cancel: threading.Event) -> None:
        with self.ledger.lock:
            job = self.ledger.get(job_id)
            try:
                stage = get_stage(job.stage)
                cfg = validate_config(stage, job.config)
                self.admission.check(stage, job.config)  # the allowlist may have narrowed since StartJob
                inputs = resolve_inputs(stage, cfg, self.ledger.run_dir)  # they may have vanished since StartJob
            except Exception as exc:  # noqa: BLE001
                self.ledger.finish(job, JobState.FAILED, "failed before it started", error=str(exc))
                return
            if cancel.is_set():  # cancelled between leaving the queue and starting
                self.ledger.finish(job, JobState.CANCELLED, "cancelled before it started")
                return
            resumed = job.attempts > 0
            job.state = JobState.RUNNING
            job.stopped_cleanly = False  # until a stop says otherwise: a restart then counts a death
            job.attempts += 1
            job.started_at = job.started_at or now_iso()
            Path(job.run_dir).mkdir(parents=True, exist_ok=True)
            self.ledger.event(job, message=f"restarted (attempt {job.attempts})" if resumed else "started")
        mode = getattr(cfg, "tracking", "") or self.tracking
        tracker = Tracker(job.run_dir, job_id, stage.name, job.config, mode=mode)
        ctx = JobContext(job_id=job_id, stage=stage.name, config=cfg, run_dir=Path(job.run_dir),
                         checkpoint_dir=Path(job.checkpoint_dir), inputs=inputs,
                         emit_fn=lambda fields: self._progress(job, fields),
                         artifact_fn=lambda art: self._artifact(job, art),
                         cancel_event=cancel, stop_event=self.stop, tracker=tracker,
                         keep_checkpoints=self.keep_checkpoints, total_steps=job.total_steps)
        with _job_log(self.ledger.store.log_path(job_id)):
            log.info("job %s (%s) running in %s (attempt %d)", job_id, stage.name, job.run_dir, job.attempts)
            self._run_stage(job, stage, inputs, ctx, tracker, cancel)

    def _run_stage(self, job: Job, stage: Stage, inputs: dict, ctx: JobContext, tracker: Tracker,
                   cancel: threading.Event) -> None:
        ledger = self.ledger
        try:
            metrics = stage.fn(ctx) or {}
        except Exception as exc:  # noqa: BLE001 - the stage's failure is the job's, not ours
            tracker.finish(exit_code=1)
            with ledger.lock:
                if cancel.is_set():
                    ledger.finish(job, JobState.CANCELLED, "cancelled")
                elif self.stop.is_set():
                    job.stopped_cleanly = True
                    ledger.event(job, message="trainer stopping; the job resumes from its last checkpoint")
                elif self.requeue_on_failure and self.requeue_on_failure(job, f"{type(exc).__name__}: {exc}"):
                    log.warning("job %s (%s) failed and was re-queued with its services' new addresses: %s",
                                job.job_id, stage.name, exc)
                else:
                    tb = traceback.format_exc()
                    log.error("job %s (%s) failed:\n%s", job.job_id, stage.name, tb)
                    ledger.finish(job, JobState.FAILED, f"failed: {type(exc).__name__}: {exc}",
                                  error=f"{type(exc).__name__}: {exc}", tb=tb)
            return
        if cancel.is_set():
            tracker.finish(exit_code=1)
            with ledger.lock:
                ledger.finish(job, JobState.CANCELLED, "cancelled")
            return
        if self.stop.is_set():
            tracker.finish()
            with ledger.lock:
                job.stopped_cleanly = True
                ledger.event(job, message="trainer stopping; the job resumes from its last checkpoint")
            return
        try:
            manifest = self._write_manifest(job, stage, inputs, metrics)
        except Exception as exc:  # noqa: BLE001
            tracker.finish(exit_code=1)
            tb = traceback.format_exc()
            log.error("job %s: could not write its manifest:\n%s", job.job_id, tb)
            with ledger.lock:
                ledger.finish(job, JobState.FAILED, "failed writing the manifest",
                              error=f"{type(exc).__name__}: {exc}", tb=tb)
            return
        tracker.summary(metrics)
        tracker.finish()
        with ledger.lock:
            ledger.finish(job, JobState.SUCCEEDED, f"succeeded; manifest {manifest}", metrics=metrics,
                          finished_at=json.loads(manifest.read_text())["finished_at"])
        log.info("job %s (%s) succeeded", job.job_id, stage.name)

    def _progress(self, job: Job, fields: dict) -> None:
        with self.ledger.lock:
            job.step = int(fields.get("step", job.step))
            if fields.get("total_steps"):
                job.total_steps = int(fields["total_steps"])
            row = dict(fields.get("metrics") or {})
            for key in ("loss", "tokens_per_s"):
                if fields.get(key) is not None:
                    row[key] = fields[key]
            job.add_metrics(row)
            if "resumed_from_step" in fields:
                job.resumed_from_step = fields["resumed_from_step"]
            fields = {k: v for k, v in fields.items() if k != "resumed_from_step"}
            fields["metrics"] = numeric(fields.get("metrics") or {})
            self.ledger.event(job, **fields)

    def _artifact(self, job: Job, art: dict) -> None:
        with self.ledger.lock:
            job.artifacts = [a for a in job.artifacts if a.name != art["name"]] + [Artifact.from_dict(art)]
            job.updated_at = now_iso()
            self.ledger.save(job)

    def _write_manifest(self, job: Job, stage: Stage, inputs: dict, metrics: dict) -> Path:
        run_dir = Path(job.run_dir)
        arts = []
        for art in job.artifacts:
            path = run_dir / art.path
            if not path.exists():
                raise FileNotFoundError(f"artifact {art.name!r} is missing: {path}")
            # re-hashed: the manifest vouches for the files as they are now
            arts.append(Artifact(name=art.name, path=art.path, sha256=sha256_tree(path)))
        with self.ledger.lock:
            job.artifacts = arts
        manifest = {
            "format": 1, "stage": stage.name, "job_id": job.job_id, "config": job.config, "inputs": inputs,
            "code_version": code_version(), "metrics": _jsonable(metrics),
            "artifacts": [dataclasses.asdict(a) for a in arts],
            "started_at": job.started_at, "finished_at": now_iso(), "attempts": job.attempts,
            "resumed_from_step": job.resumed_from_step,
        }
        return self.ledger.store.write_manifest(job.job_id, manifest)


class _ThreadFilter(logging.Filter):
    def __init__(self, thread_id: int):
        super().__init__()
        self.thread_id = thread_id

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.thread_id


@contextlib.contextmanager
def _job_log(path: Path):
    """Copy this thread's log records to the job's own log file: when the process dies under a job, the
    last lines of that job are there (each record is flushed as it is written)."""
    try:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    except OSError as exc:  # logging must never fail a job
        log.warning("no job log at %s: %s", path, exc)
        yield
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ThreadFilter(threading.get_ident()))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return json.loads(json.dumps(obj, default=str))
