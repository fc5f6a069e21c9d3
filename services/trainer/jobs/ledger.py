"""The jobs' records and events in memory: every change is written to the store, then watchers are woken."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from prorag.errors import NotFound
from services.trainer.jobs.record import Job, JobState, now_iso
from services.trainer.jobs.store import JobStore

log = logging.getLogger("prorag.trainer.jobs")


class JobLedger:
    """Records by job id, their events, and who listens to them. Thread-safe through ``lock``: callers hold it
    around what must change together (a record and its event; the manager's queue and a state), and wait on
    ``changed``, notified after every event."""

    def __init__(self, store: JobStore):
        self.store = store
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._jobs: dict[str, Job] = {}
        self._events: dict[str, list[dict]] = {}  # cache, filled on first read
        self._listeners: dict[str, set[Callable[[], None]]] = collections.defaultdict(set)

    # -- records (call with the lock held)
    def add(self, job: Job, events: list[dict] | None = None) -> None:
        """Track ``job``, with its ``events`` when the caller has them (else read on first use)."""
        self._jobs[job.job_id] = job
        if events is not None:
            self._events[job.job_id] = events

    def get(self, job_id: str) -> Job:
        """The live record; NotFound when there is none."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def find(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def jobs(self) -> list[Job]:
        """The live records, oldest first."""
        return sorted(self._jobs.values(), key=lambda j: (j.created_at, j.job_id))

    def run_dir(self, job_id: str) -> Path | None:
        """Where ``job:<job_id>`` as a stage's input points; None for a job this trainer does not know."""
        with self.lock:
            job = self._jobs.get(job_id)
            return Path(job.run_dir) if job is not None else None

    def counts(self) -> dict[JobState, int]:
        with self.lock:
            return dict(collections.Counter(j.state for j in self._jobs.values()))

    # -- events
    def load_events(self, job: Job) -> None:
        """Read the job's events, cutting a torn last line, and go on from the highest seq on disk: what a job that
        runs again needs (its record may have been saved before its last event was)."""
        events = self.store.read_events(job.job_id, repair=True)
        self._events[job.job_id] = events
        job.last_seq = max([job.last_seq] + [e["seq"] for e in events])

    def has_events(self, job_id: str) -> bool:
        return job_id in self._events

    def events_after(self, job_id: str, after_seq: int = 0) -> list[dict]:
        with self.lock:
            self.get(job_id)
            if job_id not in self._events:
                self._events[job_id] = self.store.read_events(job_id)
            return [dict(e) for e in self._events[job_id] if e["seq"] > after_seq]

    def event(self, job: Job, **fields: Any) -> dict:
        """Append the job's next event, persist its record, wake watchers (call with the lock held)."""
        seq = job.last_seq + 1
        ev = job.event(seq, **fields)
        self.store.append_event(job.job_id, ev)
        job.last_seq = seq
        job.updated_at = ev["time"]
        if job.job_id in self._events:
            self._events[job.job_id].append(ev)
        self.store.save(job)
        self._notify(job.job_id)
        return ev

    def finish(self, job: Job, state: JobState, message: str, error: str = "", tb: str = "",
               metrics: dict | None = None, finished_at: str | None = None) -> None:
        """The job ends in ``state``; a SUCCEEDED one's event carries its metrics and artifacts (lock held)."""
        job.state = state
        job.error = error
        job.traceback = tb
        if metrics:
            job.add_metrics(metrics)
            # a stage names what it published (registry references) with string values
            job.outputs.update({k: v for k, v in metrics.items() if isinstance(v, str)})
        job.finished_at = finished_at or now_iso()
        succeeded = state is JobState.SUCCEEDED
        self.event(job, message=message, metrics=dict(job.metrics) if succeeded else None,
                   artifacts=[dataclasses.asdict(a) for a in job.artifacts] if succeeded else None)

    def save(self, job: Job) -> None:
        """Persist a change that makes no event (lock held)."""
        self.store.save(job)

    # -- watchers
    def add_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        """``fn()`` is called (from any thread) after every new event of ``job_id``."""
        with self.lock:
            self._listeners[job_id].add(fn)

    def remove_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        with self.lock:
            self._listeners[job_id].discard(fn)
            if not self._listeners[job_id]:
                del self._listeners[job_id]

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until the job is terminal and return a snapshot of it; TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while not (job := self.get(job_id)).state.terminal:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {job_id} still {job.state.value} after {timeout}s")
                self.changed.wait(left if left is not None else 1.0)
            return job.copy()

    def _notify(self, job_id: str) -> None:
        self.changed.notify_all()
        for fn in list(self._listeners.get(job_id, ())):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a dead watcher must not break the job
                log.debug("listener of %s failed", job_id, exc_info=True)
