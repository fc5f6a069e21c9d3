"""The JobManager: accepts jobs, queues them, runs them on worker threads and answers the servicer."""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from prorag.validation import DEFAULT_ALLOWED_ENDPOINTS
from services.trainer.jobs.admission import Admission, paths_of_the_config
from services.trainer.jobs.ledger import JobLedger
from services.trainer.jobs.record import Job, JobState, now_iso
from services.trainer.jobs.runner import JobRunner
from services.trainer.jobs.store import JobStore
from services.trainer.stages import get_stage, known_stages, resolve_inputs, work_differences

log = logging.getLogger("prorag.trainer.jobs")


def queued_message(ahead: list[Job], workers: int) -> str:
    """A new job's first event: "queued", naming what it waits behind when every worker is taken, so a run whose
    job does not start says why (e.g. an unfinished job of an earlier run, resumed when this trainer started)."""
    running = sum(j.state is JobState.RUNNING for j in ahead)
    if running < workers and len(ahead) == running:  # a free worker and nobody queued before it
        return "queued"
    names = ", ".join(f"{j.job_id} ({j.stage}, {j.state.value.lower()})" for j in ahead[:3])
    more = f" and {len(ahead) - 3} more" if len(ahead) > 3 else ""
    return f"queued behind {names}{more}: the trainer runs {workers} job(s) at a time"


class JobManager:
    """Accepts, persists and runs jobs, ``parallel_jobs`` at a time in FIFO order; thread-safe; used by the
    gRPC servicer. What it returns are snapshots: later changes of a job do not reach them.

    Why more than one: a small policy's training step stops speeding up after a few threads, so on a machine
    with many cores several jobs side by side finish sooner than one after another (on 2 cores, two jobs of 1
    thread gave 17% more steps than one job of 2, docs/BENCHMARKS.md). torch's thread count is global to the
    process, so jobs running together should each ask for ``threads`` = cores / parallel_jobs."""

    def __init__(self, root: str | Path, *, keep_checkpoints: int = 2, tracking: str = "wandb",
                 parallel_jobs: int = 1, max_attempts: int = 3,
                 allowed_endpoints: Sequence[str] = DEFAULT_ALLOWED_ENDPOINTS,
                 service_addresses: dict[str, str] | None = None, max_queued_jobs: int = 256,
                 memory_check: bool = True):
        if parallel_jobs < 1:
            raise ValueError(f"parallel_jobs must be >= 1, got {parallel_jobs}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.parallel_jobs = parallel_jobs
        self.max_attempts = max_attempts
        self.max_queued = max_queued_jobs
        self.store = JobStore(root)
        self.admission = Admission(self.store.root, allowed_endpoints, service_addresses or {},
                                   memory_check=memory_check)
        self.ledger = JobLedger(self.store)
        self._stop = threading.Event()
        #: job id -> (config dict, json) of a submission that moved a RUNNING job's services: taken if it fails
        self._readdress: dict[str, tuple[dict, str]] = {}
        self._requeue_after_run: set[str] = set()  # re-addressed on failure: queued when its worker lets go of it
        self.runner = JobRunner(self.ledger, self.admission, self._stop, keep_checkpoints=keep_checkpoints,
                                tracking=tracking, requeue_on_failure=self._take_readdress)
        self._lock_fd: int | None = None
        self._queue: collections.deque[str] = collections.deque()
        self._cancel: dict[str, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self.running: set[str] = set()
        self.loaded = False

    # -- lifecycle
    def load(self) -> None:
        """Lock the root; read every job; re-queue the ones a killed trainer left QUEUED or RUNNING, unless
        their process died under them ``max_attempts`` times."""
        if self._lock_fd is None:
            self._lock_fd = self.store.lock()
        try:
            self._load_locked()
        except BaseException:
            self._release_lock()
            raise

    def _load_locked(self) -> None:
        jobs = sorted(self.store.load_all(), key=lambda j: (j.created_at, j.job_id))
        with self.ledger.lock:
            for job in jobs:
                self.ledger.add(job)
                self._cancel[job.job_id] = threading.Event()
                if not job.state.terminal:
                    self._recover(job)
            self.loaded = True
        log.info("job store %s: %d jobs, %d queued", self.store.root, len(jobs), len(self._queue))

    def _recover(self, job: Job) -> None:
        """A job a killed trainer left QUEUED or RUNNING: done if its manifest is there, cancelled if that was
        asked, else queued again (unless its process died under it too often)."""
        self.ledger.load_events(job)
        manifest = self.store.run_dir(job.job_id) / "manifest.json"
        if manifest.is_file():
            # Killed after the manifest (the last output) but before the record said so.
            m = json.loads(manifest.read_text())
            self.ledger.finish(job, JobState.SUCCEEDED, "succeeded (recovered from manifest after a restart)",
                               metrics=m.get("metrics", {}), finished_at=m.get("finished_at"))
        elif job.cancel_requested:
            self.ledger.finish(job, JobState.CANCELLED, "cancelled (the trainer stopped before the job did)")
        else:
            was, died = job.state, job.state is JobState.RUNNING and not job.stopped_cleanly
            if died and self._died_too_often(job):
                return
            job.state = JobState.QUEUED
            why = (f"; its process died under it ({job.process_deaths} of max_attempts "
                   f"{self.max_attempts})" if died else "")
            self.ledger.event(job, message=f"re-queued after a trainer restart (was {was.value}{why}); "
                                           "resumes from its last checkpoint")
            self._queue.append(job.job_id)

    def _died_too_often(self, job: Job) -> bool:
        """Count one more death of the job's process (it was RUNNING and never stopped cleanly); FAILED
        and True once that makes ``max_attempts``. The count is in the job record, saved atomically."""
        job.process_deaths += 1
        deaths = job.process_deaths
        if deaths < self.max_attempts:
            self.ledger.save(job)  # counted before the job runs again, so its next death counts too
            return False
        why = (f"the job's process died {deaths} time{'s' if deaths != 1 else ''} while running "
               f"(last at step {job.step}); not retried (max_attempts {self.max_attempts}): see "
               f"{self.store.log_path(job.job_id)} and the trainer's log")
        self.ledger.finish(job, JobState.FAILED, f"failed: {why}", error=why)
        return True

    def start(self) -> None:
        if not self.loaded:
            self.load()
        self._threads = [threading.Thread(target=self._worker, name=f"trainer-jobs-{i}", daemon=True)
                         for i in range(self.parallel_jobs)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the running stage to stop (it checkpoints; the job resumes on the next start) and wait."""
        self._stop.set()
        with self.ledger.changed:
            self.ledger.changed.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("jobs %s did not stop within %.0fs; they resume from their last checkpoint on restart",
                        sorted(self.running), timeout)
            return  # a job still writes to the root: keep it locked until this process exits
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _ready(self) -> None:
        if not self.loaded:
            raise Unavailable("the trainer is still loading its job store; retry shortly")

    # -- API
    def submit(self, stage_name: str, config: str | dict | None = None, job_id: str = "") -> Job:
        if not stage_name:
            raise InvalidArgument(f"stage is required; known stages: {', '.join(known_stages())}")
        self._ready()
        stage = get_stage(stage_name)
        cfg, cfg_dict, cfg_json = self.admission.config(stage, config)
        job_id = self.admission.job_id(stage, job_id)
        with self.ledger.lock:
            existing = self.ledger.find(job_id)
            if existing is not None:
                if existing.stage == stage.name and existing.config_json == cfg_json:
                    if existing.state in (JobState.FAILED, JobState.CANCELLED):
                        return self._requeue(existing)
                    return existing.copy()  # idempotent retry of the same submission
                if existing.stage != stage.name:
                    raise AlreadyExists(f"job {job_id!r} already exists with a different stage ({existing.stage}); "
                                        "pick another job_id")
                differ = work_differences(stage, existing.config, cfg_dict)
                if not differ:
                    return self._readdressed(existing, cfg_dict, cfg_json)
                raise AlreadyExists(f"job {job_id!r} already exists with a different config ("
                                    f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}); "
                                    "pick another job_id")
            if self.store.exists(job_id):
                raise AlreadyExists(f"job {job_id!r}: {self.store.job_dir(job_id)} exists but is not a loadable job")
            queued = sum(1 for j in self.ledger.jobs() if j.state is JobState.QUEUED)
            if queued >= self.max_queued:
                raise ResourceExhausted(f"{queued} jobs are already queued (max_queued_jobs {self.max_queued}); "
                                        "wait for some to finish or cancel some, then submit again")
            with paths_of_the_config():
                inputs = resolve_inputs(stage, cfg, self.ledger.run_dir)
            ts = now_iso()
            job = Job(job_id=job_id, stage=stage.name, state=JobState.QUEUED, config=cfg_dict, config_json=cfg_json,
                      inputs=inputs, run_dir=str(self.store.run_dir(job_id).resolve()),
                      checkpoint_dir=str(self.store.checkpoint_dir(job_id).resolve()), created_at=ts, updated_at=ts,
                      last_seq=1)
            first = job.event(seq=1, message=queued_message(self._ahead(), self.parallel_jobs))
            self.store.create(job, first)
            self.ledger.add(job, [first])
            self._cancel[job_id] = threading.Event()
            self._enqueue(job_id)
            log.info("job %s (%s) queued", job_id, stage.name)
            return job.copy()

    def _readdressed(self, job: Job, cfg_dict: dict, cfg_json: str) -> Job:
        """The same job submitted again with its services at other addresses (a run resumed with another
        --port-offset), or with fields added since at their defaults: a job that is not running takes the new
        config, so it runs or resumes against the addresses given (FAILED or CANCELLED: re-queued as by
        _requeue). A finished job is returned as it is (where its services were does not change what it made).
        A running one goes on with the addresses it started with; should it fail (a trainer restarted by the new
        run resumed it against the old run's services, which are gone), it is re-queued with the new ones before
        anyone sees it fail (lock held)."""
        if job.state is JobState.SUCCEEDED:
            return job.copy()
        if job.state is JobState.RUNNING:
            self._readdress[job.job_id] = (cfg_dict, cfg_json)
            self.ledger.event(job, message="submitted again with its services at other addresses while running: it "
                                           "goes on with the ones it started with, and if it fails it resumes with "
                                           "the new ones")
            return job.copy()
        moved = sorted(k for k in set(job.config) | set(cfg_dict) if job.config.get(k) != cfg_dict.get(k))
        job.config, job.config_json = cfg_dict, cfg_json
        self.ledger.event(job, message="submitted again with the same work and its services at other addresses; "
                                       "it now uses " + ", ".join(f"{k}={cfg_dict.get(k)}" for k in moved))
        if job.state in (JobState.FAILED, JobState.CANCELLED):
            return self._requeue(job)
        return job.copy()

    def _take_readdress(self, job: Job, why: str) -> bool:
        """Called by the runner, lock held, when a running job fails: if a submission moved its services meanwhile,
        the job takes that config and goes back to QUEUED (the worker queues it once it has let go of it), and
        True; else False and the job fails as usual."""
        pending = self._readdress.pop(job.job_id, None)
        if pending is None:
            return False
        moved = sorted(k for k in set(job.config) | set(pending[0]) if job.config.get(k) != pending[0].get(k))
        job.config, job.config_json = pending
        job.state = JobState.QUEUED
        self._requeue_after_run.add(job.job_id)
        self.ledger.event(job, message=f"failed against the services it started with ({why}); re-queued with the "
                                       "addresses of the latest submission, " +
                                       ", ".join(f"{k}={pending[0].get(k)}" for k in moved) +
                                       "; resumes from its last checkpoint")
        return True

    def _requeue(self, job: Job) -> Job:
        """A FAILED or CANCELLED job submitted again with the same config runs again, resuming from its last
        checkpoint (its record, events and run directory go on): a person retrying after fixing what failed
        (a service that was down, a full disk) must not have to pick a new job id and start from step 0."""
        was, why = job.state, job.error
        if not self.ledger.has_events(job.job_id):  # terminal jobs' events are not loaded at start-up
            self.ledger.load_events(job)
        job.state, job.error, job.traceback, job.finished_at = JobState.QUEUED, "", "", ""
        job.cancel_requested, job.process_deaths = False, 0
        self._cancel[job.job_id] = threading.Event()
        self.ledger.event(job, message=f"re-queued by a new submission of the same config (was {was.value}"
                                       + (f": {why}" if why else "") + "); resumes from its last checkpoint")
        self._enqueue(job.job_id)
        log.info("job %s re-queued (was %s)", job.job_id, was.value)
        return job.copy()

    def cancel(self, job_id: str) -> Job:
        self._ready()
        with self.ledger.lock:
            job = self.ledger.get(job_id)
            if job.state.terminal:
                raise FailedPrecondition(f"job {job_id!r} is already {job.state.value}; nothing to cancel")
            if job.state is JobState.QUEUED and job_id not in self.running:
                self._queue.remove(job_id)
                self.ledger.finish(job, JobState.CANCELLED, "cancelled before it started")
                return job.copy()
            if not job.cancel_requested:
                job.cancel_requested = True
                self._cancel[job_id].set()
                self.ledger.event(job, message="cancel requested; the stage stops at its next step")
            return job.copy()

    def get(self, job_id: str) -> Job:
        self._ready()
        with self.ledger.lock:
            return self.ledger.get(job_id).copy()

    def list(self, stage: str = "") -> list[Job]:
        self._ready()
        with self.ledger.lock:
            return [j.copy() for j in self.ledger.jobs() if not stage or j.stage == stage]

    def state_counts(self) -> dict[JobState, int]:
        """Jobs per state (what /metrics shows); empty before the store is loaded."""
        return self.ledger.counts()

    def _ahead(self) -> list[Job]:
        """The jobs a new one waits behind: the running ones, then the queue in its order (caller holds the lock)."""
        running = [j for j in self.ledger.jobs() if j.state is JobState.RUNNING]
        return running + [self.ledger.get(job_id) for job_id in self._queue]

    def events_after(self, job_id: str, after_seq: int = 0) -> list[dict]:
        self._ready()
        return self.ledger.events_after(job_id, after_seq)

    def add_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        """``fn()`` is called (from any thread) after every new event of ``job_id``."""
        self.ledger.add_listener(job_id, fn)

    def remove_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        self.ledger.remove_listener(job_id, fn)

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until the job is terminal; TimeoutError after ``timeout`` seconds."""
        return self.ledger.wait(job_id, timeout)

    # -- the workers
    def _enqueue(self, job_id: str) -> None:
        self._queue.append(job_id)
        self.ledger.changed.notify_all()

    def _worker(self) -> None:
        while True:
            with self.ledger.changed:
                while not self._queue and not self._stop.is_set():
                    self.ledger.changed.wait()
                if self._stop.is_set():
                    return
                job_id = self._queue.popleft()
                self.running.add(job_id)
                cancel = self._cancel[job_id]
            try:
                self.runner.run(job_id, cancel)
            except Exception:  # noqa: BLE001 - a manager bug must not kill the worker
                log.exception("job %s: unexpected error in the job manager", job_id)
                with self.ledger.lock:
                    job = self.ledger.get(job_id)
                    if not job.state.terminal:
                        self.ledger.finish(job, JobState.FAILED, "failed",
                                           error="internal trainer error; see the trainer log",
                                           tb=traceback.format_exc())
            finally:
                with self.ledger.changed:
                    self.running.discard(job_id)
                    job = self.ledger.get(job_id)
                    if job.state.terminal:
                        self._readdress.pop(job_id, None)  # it finished with the addresses it had
                    if job_id in self._requeue_after_run:  # re-addressed after failing: runs again with them
                        self._requeue_after_run.discard(job_id)
                        if not self._stop.is_set():  # else the next start's recovery queues it
                            self._enqueue(job_id)
