"""Persistent training jobs: the on-disk JobStore and the JobManager that runs them.

Layout under the jobs root (default ``<PRORAG_HOME>/runs/jobs``)::

    .trainer.lock            flock'ed by the one trainer using this root (its pid inside)
    <job_id>/job.json        the job record, replaced atomically on every change
    <job_id>/events.jsonl    one JSON event per line, fsynced per event; seq survives restarts
    <job_id>/job.log         log records of the job's worker thread, appended per attempt
    <job_id>/checkpoints/    step-<N>.pt, last K kept
    <job_id>/run/            outputs: artifacts, metrics.jsonl, wandb/, and manifest.json (written last)

Jobs run in worker threads of the trainer process (one at a time by default; ``parallel_jobs``
workers side by side), so killing the trainer kills its jobs too. On start the manager re-queues jobs a killed trainer left
QUEUED or RUNNING; their stages resume from the last checkpoint. A job whose process died under it
``max_attempts`` times (a crash it causes, e.g. out of memory, would otherwise loop forever) is FAILED
instead. One trainer at a time owns a jobs root (an exclusive flock held for the manager's life): two
would run the same queued jobs side by side and corrupt their records.
"""

from __future__ import annotations

import dataclasses

import collections
import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from prorag.rpc import jsonbody
from prorag.config import to_dict
from prorag.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted,
                           Unavailable)
from prorag.io import atomic_dir, write_json
from prorag.runs import code_version
from prorag.training.context import JobContext, sha256_tree
from prorag.validation import DEFAULT_ALLOWED_ENDPOINTS, check_allowed_endpoints, data_roots
from services.trainer.stages import Stage, check_job_config, get_stage, known_stages, resolve_inputs, validate_config
from services.trainer.tracking import Tracker

log = logging.getLogger("prorag.trainer.jobs")

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
MAX_CONFIG_BYTES = 1 << 20
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LOCK_NAME = ".trainer.lock"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------- the store
class JobStore:
    """Files of every job under ``root``; no caching, no locking (the manager does both)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def log_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "job.log"

    def lock(self) -> int:
        """Take the root's exclusive lock; returns the open fd that holds it (closing it releases the lock,
        and so does the process dying, however it dies). Another holder -> FailedPrecondition naming it."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"jobs root {self.root} is in use by another trainer ({holder}); run one trainer per jobs root: "
                f"stop that one, or give this one another jobs_root") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now_iso()}\n".encode(), 0)
        return fd

    def run_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "run"

    def checkpoint_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "checkpoints"

    def exists(self, job_id: str) -> bool:
        return self.job_dir(job_id).exists()

    def create(self, record: dict, first_event: dict) -> None:
        """The job's directory with job.json and its first event appears in one rename."""
        with atomic_dir(self.job_dir(record["job_id"])) as tmp:
            write_json(tmp / "job.json", record)
            with open(tmp / "events.jsonl", "w") as fh:
                fh.write(json.dumps(first_event, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def save(self, record: dict) -> None:
        write_json(self.job_dir(record["job_id"]) / "job.json", record)

    def load(self, job_id: str) -> dict:
        return json.loads((self.job_dir(job_id) / "job.json").read_text())

    def load_all(self) -> list[dict]:
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith("."):
                if d.name.endswith(".tmp"):  # a creation a kill interrupted: never visible as a job
                    shutil.rmtree(d, ignore_errors=True)
                continue
            if not (d / "job.json").is_file():
                continue
            try:
                out.append(self.load(d.name))
            except (OSError, ValueError) as exc:
                log.warning("skipping job %s: unreadable job.json (%s)", d.name, exc)
        return out

    def append_event(self, job_id: str, event: dict) -> None:
        line = (json.dumps(event, sort_keys=True) + "\n").encode()
        with open(self.job_dir(job_id) / "events.jsonl", "ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def read_events(self, job_id: str, repair: bool = False) -> list[dict]:
        """Every complete event; a torn last line (a kill mid-append) is ignored, and cut off if ``repair``."""
        path = self.job_dir(job_id) / "events.jsonl"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end < len(data) and repair:
            # The next append must start on a fresh line, not glue onto the torn one.
            with open(path, "r+b") as fh:
                fh.truncate(end)
                os.fsync(fh.fileno())
        events = []
        for lineno, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except ValueError:
                log.warning("%s:%d: skipping an unreadable event", path, lineno)
        return events

    def write_manifest(self, job_id: str, manifest: dict) -> Path:
        path = self.run_dir(job_id) / "manifest.json"
        write_json(path, manifest)
        return path


@contextlib.contextmanager
def _paths_of_the_config():
    """A path a submitted config names that cannot even be looked at (a name too long for the file system, a
    directory the trainer may not read) is the caller's to fix, not a server error."""
    try:
        yield
    except OSError as e:
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name):,} characters)"
        if e.errno == errno.ENAMETOOLONG:
            raise InvalidArgument(f"config_json names a path that is too long: {shown}") from None
        raise FailedPrecondition(f"config_json names {shown}, which the trainer cannot read: "
                                 f"{e.strerror or e}") from None


# ---------------------------------------------------------------- the manager
class JobManager:
    """Accepts, persists and runs jobs, ``parallel_jobs`` at a time in FIFO order; thread-safe; used by the
    gRPC servicer.

    Why more than one: a small policy's training step stops speeding up after a few threads, so on a machine
    with many cores several jobs side by side finish sooner than one after another (on 2 cores, two jobs of 1
    thread gave 17% more steps than one job of 2, docs/BENCHMARKS.md). torch's thread count is global to the
    process, so jobs running together should each ask for ``threads`` = cores / parallel_jobs."""

    def __init__(self, root: str | Path, *, keep_checkpoints: int = 2, tracking: str = "wandb",
                 parallel_jobs: int = 1, max_attempts: int = 3,
                 allowed_endpoints: Sequence[str] = DEFAULT_ALLOWED_ENDPOINTS,
                 service_addresses: dict[str, str] | None = None, max_queued_jobs: int = 256):
        if parallel_jobs < 1:
            raise ValueError(f"parallel_jobs must be >= 1, got {parallel_jobs}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.parallel_jobs = parallel_jobs
        self.max_attempts = max_attempts
        self.allowed_endpoints = check_allowed_endpoints(allowed_endpoints)
        self.service_addresses = dict(service_addresses or {})
        self.max_queued = max_queued_jobs
        self._lock_fd: int | None = None
        self.store = JobStore(root)
        self.keep_checkpoints = keep_checkpoints
        self.tracking = tracking
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, dict] = {}
        self._events: dict[str, list[dict]] = {}  # cache, filled on first read
        self._queue: collections.deque[str] = collections.deque()
        self._cancel: dict[str, threading.Event] = {}
        self._listeners: dict[str, set[Callable[[], None]]] = collections.defaultdict(set)
        self._stop = threading.Event()
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
        records = sorted(self.store.load_all(), key=lambda r: (r.get("created_at", ""), r["job_id"]))
        with self._lock:
            for rec in records:
                job_id = rec["job_id"]
                self._jobs[job_id] = rec
                self._cancel[job_id] = threading.Event()
                if rec["state"] in TERMINAL:
                    continue
                events = self.store.read_events(job_id, repair=True)
                self._events[job_id] = events
                rec["last_seq"] = max([rec.get("last_seq", 0)] + [e["seq"] for e in events])
                manifest = self.store.run_dir(job_id) / "manifest.json"
                if manifest.is_file():
                    # Killed after the manifest (the last output) but before the record said so.
                    m = json.loads(manifest.read_text())
                    self._finish(rec, SUCCEEDED, "succeeded (recovered from manifest after a restart)",
                                 metrics=m.get("metrics", {}), finished_at=m.get("finished_at"))
                elif rec.get("cancel_requested"):
                    self._finish(rec, CANCELLED, "cancelled (the trainer stopped before the job did)")
                else:
                    was, died = rec["state"], rec["state"] == RUNNING and not rec.get("stopped_cleanly")
                    if died and self._died_too_often(rec):
                        continue
                    rec["state"] = QUEUED
                    why = (f"; its process died under it ({rec['process_deaths']} of max_attempts "
                           f"{self.max_attempts})" if died else "")
                    self._event(rec, message=f"re-queued after a trainer restart (was {was}{why}); "
                                             "resumes from its last checkpoint")
                    self._queue.append(job_id)
            self.loaded = True
        log.info("job store %s: %d jobs, %d queued", self.store.root, len(self._jobs), len(self._queue))

    def _died_too_often(self, rec: dict) -> bool:
        """Count one more death of the job's process (it was RUNNING and never stopped cleanly); FAILED
        and True once that makes ``max_attempts``. The count is in the job record, saved atomically."""
        rec["process_deaths"] = int(rec.get("process_deaths", 0)) + 1
        deaths = rec["process_deaths"]
        if deaths < self.max_attempts:
            self.store.save(rec)  # counted before the job runs again, so its next death counts too
            return False
        why = (f"the job's process died {deaths} time{'s' if deaths != 1 else ''} while running "
               f"(last at step {rec['step']}); not retried (max_attempts {self.max_attempts}): see "
               f"{self.store.log_path(rec['job_id'])} and the trainer's log")
        self._finish(rec, FAILED, f"failed: {why}", error=why)
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
        with self._wake:
            self._wake.notify_all()
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
    def submit(self, stage_name: str, config: str | dict | None = None, job_id: str = "") -> dict:
        if not stage_name:
            raise InvalidArgument(f"stage is required; known stages: {', '.join(known_stages())}")
        self._ready()
        stage = get_stage(stage_name)
        if isinstance(config, str):
            if len(config) > MAX_CONFIG_BYTES:
                raise InvalidArgument(f"config_json has {len(config):,} characters; at most {MAX_CONFIG_BYTES:,} "
                                      "(a config names files, it does not carry data)")
            # every way the caller's JSON can fail (too deeply nested, an integer of 5,000 digits...) is theirs
            config = jsonbody.loads(config, "config_json") if config.strip() else {}
        if config is None:
            config = {}
        if isinstance(config, dict) and self.service_addresses:
            # the deployment's addresses for what the job leaves unset (its 127.0.0.1 defaults reach nothing
            # in a container); only fields this stage's config has
            fields = {f.name for f in dataclasses.fields(stage.config_cls)}
            config = {**{k: v for k, v in self.service_addresses.items() if k in fields}, **config}
        with _paths_of_the_config():
            if isinstance(config, dict):
                # before the config's own validation, which may look at the paths it names (is_dir...)
                self._check_config(stage, config)
            cfg = validate_config(stage, config)
            cfg_dict = to_dict(cfg)
            self._check_config(stage, cfg_dict)  # the defaults too
        cfg_json = canonical_json(cfg_dict)
        if job_id:
            if not JOB_ID_RE.match(job_id):
                raise InvalidArgument(f"job_id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
                                      "starting with a letter or digit")
        else:
            job_id = f"{stage.name}-{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            existing = self._jobs.get(job_id)
            if existing is not None:
                if existing["stage"] == stage.name and existing["config_json"] == cfg_json:
                    if existing["state"] in (FAILED, CANCELLED):
                        return self._requeue(existing)
                    return self._copy(existing)  # idempotent retry of the same submission
                raise AlreadyExists(f"job {job_id!r} already exists with a different "
                                    f"{'stage' if existing['stage'] != stage.name else 'config'}; "
                                    "pick another job_id")
            if self.store.exists(job_id):
                raise AlreadyExists(f"job {job_id!r}: {self.store.job_dir(job_id)} exists but is not a loadable job")
            queued = sum(1 for r in self._jobs.values() if r["state"] == QUEUED)
            if queued >= self.max_queued:
                raise ResourceExhausted(f"{queued} jobs are already queued (max_queued_jobs {self.max_queued}); "
                                        "wait for some to finish or cancel some, then submit again")
            with _paths_of_the_config():
                inputs = resolve_inputs(stage, cfg, self._job_run_dir)
            ts = now_iso()
            rec = {
                "job_id": job_id, "stage": stage.name, "state": QUEUED, "config": cfg_dict, "config_json": cfg_json,
                "inputs": inputs, "run_dir": str(self.store.run_dir(job_id).resolve()),
                "checkpoint_dir": str(self.store.checkpoint_dir(job_id).resolve()),
                "step": 0, "total_steps": 0, "error": "", "traceback": "", "artifacts": [], "metrics": {},
                "created_at": ts, "updated_at": ts, "started_at": "", "finished_at": "", "attempts": 0,
                "last_seq": 1, "cancel_requested": False, "resumed_from_step": None,
            }
            first = self._event_record(rec, seq=1, message="queued")
            self.store.create(rec, first)
            self._jobs[job_id] = rec
            self._events[job_id] = [first]
            self._cancel[job_id] = threading.Event()
            self._queue.append(job_id)
            self._wake.notify_all()
            log.info("job %s (%s) queued", job_id, stage.name)
            return self._copy(rec)

    def _requeue(self, rec: dict) -> dict:
        """A FAILED or CANCELLED job submitted again with the same config runs again, resuming from its last
        checkpoint (its record, events and run directory go on): a person retrying after fixing what failed
        (a service that was down, a full disk) must not have to pick a new job id and start from step 0."""
        job_id, was, why = rec["job_id"], rec["state"], rec.get("error", "")
        if job_id not in self._events:  # terminal jobs' events are not loaded at start-up
            self._events[job_id] = self.store.read_events(job_id, repair=True)
            rec["last_seq"] = max([rec.get("last_seq", 0)] + [e["seq"] for e in self._events[job_id]])
        rec.update(state=QUEUED, error="", traceback="", finished_at="", cancel_requested=False,
                   process_deaths=0)
        self._cancel[job_id] = threading.Event()
        self._event(rec, message=f"re-queued by a new submission of the same config (was {was}"
                                 + (f": {why}" if why else "") + "); resumes from its last checkpoint")
        self._queue.append(job_id)
        self._wake.notify_all()
        log.info("job %s re-queued (was %s)", job_id, was)
        return self._copy(rec)

    def _check_config(self, stage: Stage, config: dict) -> None:
        """Names, paths and endpoints the config names (prorag.validation); InvalidArgument naming the field.
        INVALID_ARGUMENT rather than PERMISSION_DENIED: the allowlist and the data root bind every caller
        alike, so no other credentials would make this request acceptable; only a changed config would."""
        check_job_config(stage, config, roots=data_roots([self.store.root]),
                         allowed_endpoints=self.allowed_endpoints)

    def cancel(self, job_id: str) -> dict:
        self._ready()
        with self._lock:
            rec = self._get(job_id)
            if rec["state"] in TERMINAL:
                raise FailedPrecondition(f"job {job_id!r} is already {rec['state']}; nothing to cancel")
            if rec["state"] == QUEUED and job_id not in self.running:
                self._queue.remove(job_id)
                self._finish(rec, CANCELLED, "cancelled before it started")
                return self._copy(rec)
            if not rec["cancel_requested"]:
                rec["cancel_requested"] = True
                self._cancel[job_id].set()
                self._event(rec, message="cancel requested; the stage stops at its next step")
            return self._copy(rec)

    def get(self, job_id: str) -> dict:
        self._ready()
        with self._lock:
            return self._copy(self._get(job_id))

    def list(self, stage: str = "") -> list[dict]:
        self._ready()
        with self._lock:
            recs = [r for r in self._jobs.values() if not stage or r["stage"] == stage]
            return [self._copy(r) for r in sorted(recs, key=lambda r: (r["created_at"], r["job_id"]))]

    def state_counts(self) -> dict[str, int]:
        """Jobs per state (what /metrics shows); empty before the store is loaded."""
        with self._lock:
            counts: dict[str, int] = {}
            for r in self._jobs.values():
                counts[r["state"]] = counts.get(r["state"], 0) + 1
            return counts

    def events_after(self, job_id: str, after_seq: int = 0) -> list[dict]:
        self._ready()
        with self._lock:
            self._get(job_id)
            if job_id not in self._events:
                self._events[job_id] = self.store.read_events(job_id)
            return [dict(e) for e in self._events[job_id] if e["seq"] > after_seq]

    def add_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        """``fn()`` is called (from any thread) after every new event of ``job_id``."""
        with self._lock:
            self._listeners[job_id].add(fn)

    def remove_listener(self, job_id: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners[job_id].discard(fn)
            if not self._listeners[job_id]:
                del self._listeners[job_id]

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        """Block until the job is terminal; TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while self._get(job_id)["state"] not in TERMINAL:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {job_id} still {self._jobs[job_id]['state']} after {timeout}s")
                self._wake.wait(left if left is not None else 1.0)
            return self._copy(self._jobs[job_id])

    # -- internals (call with the lock held)
    def _get(self, job_id: str) -> dict:
        rec = self._jobs.get(job_id)
        if rec is None:
            raise NotFound(f"job {job_id!r} not found")
        return rec

    @staticmethod
    def _copy(rec: dict) -> dict:
        return json.loads(json.dumps(rec))

    def _job_run_dir(self, job_id: str) -> Path | None:
        rec = self._jobs.get(job_id)
        return Path(rec["run_dir"]) if rec is not None else None

    def _event_record(self, rec: dict, seq: int, **fields: Any) -> dict:
        ev = {"job_id": rec["job_id"], "seq": seq, "state": rec["state"], "time": now_iso(),
              "step": rec["step"], "total_steps": rec["total_steps"], "message": ""}
        ev.update({k: v for k, v in fields.items() if v is not None})
        return ev

    def _event(self, rec: dict, save: bool = True, **fields: Any) -> dict:
        """Append the next event of ``rec`` (seq + 1), persist the record, wake watchers."""
        seq = rec["last_seq"] + 1
        ev = self._event_record(rec, seq, **fields)
        self.store.append_event(rec["job_id"], ev)
        rec["last_seq"] = seq
        rec["updated_at"] = ev["time"]
        if rec["job_id"] in self._events:
            self._events[rec["job_id"]].append(ev)
        if save:
            self.store.save(rec)
        self._notify(rec["job_id"])
        return ev

    def _notify(self, job_id: str) -> None:
        self._wake.notify_all()
        for fn in list(self._listeners.get(job_id, ())):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a dead watcher must not break the job
                log.debug("listener of %s failed", job_id, exc_info=True)

    def _finish(self, rec: dict, state: str, message: str, error: str = "", tb: str = "",
                metrics: dict | None = None, finished_at: str | None = None) -> None:
        rec["state"] = state
        rec["error"] = error
        rec["traceback"] = tb
        if metrics:
            rec["metrics"].update({k: float(v) for k, v in metrics.items() if _is_number(v)})
            # a stage names what it published (registry references) with string values
            rec.setdefault("outputs", {}).update({k: v for k, v in metrics.items() if isinstance(v, str)})
        rec["finished_at"] = finished_at or now_iso()
        self._event(rec, message=message, metrics=rec["metrics"] if state == SUCCEEDED else None,
                    artifacts=rec["artifacts"] if state == SUCCEEDED else None)

    # -- the worker
    def _worker(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stop.is_set():
                    self._wake.wait()
                if self._stop.is_set():
                    return
                job_id = self._queue.popleft()
                self.running.add(job_id)
            try:
                self._run(job_id)
            except Exception:  # noqa: BLE001 - a manager bug must not kill the worker
                log.exception("job %s: unexpected error in the job manager", job_id)
                with self._lock:
                    rec = self._jobs[job_id]
                    if rec["state"] not in TERMINAL:
                        self._finish(rec, FAILED, "failed", error="internal trainer error; see the trainer log",
                                     tb=traceback.format_exc())
            finally:
                with self._lock:
                    self.running.discard(job_id)

    def _run(self, job_id: str) -> None:
        with self._lock:
            rec = self._jobs[job_id]
            try:
                stage = get_stage(rec["stage"])
                cfg = validate_config(stage, rec["config"])
                self._check_config(stage, rec["config"])  # the allowlist may have narrowed since StartJob
                inputs = resolve_inputs(stage, cfg, self._job_run_dir)  # they may have vanished since StartJob
            except Exception as exc:  # noqa: BLE001
                self._finish(rec, FAILED, "failed before it started", error=str(exc))
                return
            if self._cancel[job_id].is_set():  # cancelled between leaving the queue and starting
                self._finish(rec, CANCELLED, "cancelled before it started")
                return
            resumed = rec["attempts"] > 0
            rec["state"] = RUNNING
            rec["stopped_cleanly"] = False  # until a stop says otherwise: a restart then counts a death
            rec["attempts"] += 1
            rec["started_at"] = rec["started_at"] or now_iso()
            Path(rec["run_dir"]).mkdir(parents=True, exist_ok=True)
            self._event(rec, message=f"restarted (attempt {rec['attempts']})" if resumed else "started")
        cancel = self._cancel[job_id]
        mode = getattr(cfg, "tracking", "") or self.tracking
        tracker = Tracker(rec["run_dir"], job_id, stage.name, rec["config"], mode=mode)
        ctx = JobContext(job_id=job_id, stage=stage.name, config=cfg, run_dir=Path(rec["run_dir"]),
                         checkpoint_dir=Path(rec["checkpoint_dir"]), inputs=inputs,
                         emit_fn=lambda fields: self._progress(job_id, fields),
                         artifact_fn=lambda art: self._artifact(job_id, art),
                         cancel_event=cancel, stop_event=self._stop, tracker=tracker,
                         keep_checkpoints=self.keep_checkpoints, total_steps=rec["total_steps"])
        with _job_log(self.store.log_path(job_id)):
            log.info("job %s (%s) running in %s (attempt %d)", job_id, stage.name, rec["run_dir"], rec["attempts"])
            self._run_stage(job_id, rec, stage, cfg, inputs, ctx, tracker, cancel)

    def _run_stage(self, job_id: str, rec: dict, stage: Stage, cfg: Any, inputs: dict, ctx: JobContext,
                   tracker: Tracker, cancel: threading.Event) -> None:
        try:
            metrics = stage.fn(ctx) or {}
        except Exception as exc:  # noqa: BLE001 - the stage's failure is the job's, not ours
            tracker.finish(exit_code=1)
            with self._lock:
                if cancel.is_set():
                    self._finish(rec, CANCELLED, "cancelled")
                elif self._stop.is_set():
                    rec["stopped_cleanly"] = True
                    self._event(rec, message="trainer stopping; the job resumes from its last checkpoint")
                else:
                    tb = traceback.format_exc()
                    log.error("job %s (%s) failed:\n%s", job_id, stage.name, tb)
                    self._finish(rec, FAILED, f"failed: {type(exc).__name__}: {exc}",
                                 error=f"{type(exc).__name__}: {exc}", tb=tb)
            return
        if cancel.is_set():
            tracker.finish(exit_code=1)
            with self._lock:
                self._finish(rec, CANCELLED, "cancelled")
            return
        if self._stop.is_set():
            tracker.finish()
            with self._lock:
                rec["stopped_cleanly"] = True
                self._event(rec, message="trainer stopping; the job resumes from its last checkpoint")
            return
        try:
            manifest = self._write_manifest(rec, stage, inputs, metrics)
        except Exception as exc:  # noqa: BLE001
            tracker.finish(exit_code=1)
            tb = traceback.format_exc()
            log.error("job %s: could not write its manifest:\n%s", job_id, tb)
            with self._lock:
                self._finish(rec, FAILED, "failed writing the manifest", error=f"{type(exc).__name__}: {exc}", tb=tb)
            return
        tracker.summary(metrics)
        tracker.finish()
        with self._lock:
            self._finish(rec, SUCCEEDED, f"succeeded; manifest {manifest}", metrics=metrics,
                         finished_at=json.loads(manifest.read_text())["finished_at"])
        log.info("job %s (%s) succeeded", job_id, stage.name)

    def _progress(self, job_id: str, fields: dict) -> None:
        with self._lock:
            rec = self._jobs[job_id]
            rec["step"] = int(fields.get("step", rec["step"]))
            if fields.get("total_steps"):
                rec["total_steps"] = int(fields["total_steps"])
            row = dict(fields.get("metrics") or {})
            for key in ("loss", "tokens_per_s"):
                if fields.get(key) is not None:
                    row[key] = fields[key]
            rec["metrics"].update({k: float(v) for k, v in row.items() if _is_number(v)})
            if "resumed_from_step" in fields:
                rec["resumed_from_step"] = fields["resumed_from_step"]
            fields = {k: v for k, v in fields.items() if k not in ("resumed_from_step",)}
            fields["metrics"] = {k: float(v) for k, v in (fields.get("metrics") or {}).items() if _is_number(v)}
            self._event(rec, **fields)

    def _artifact(self, job_id: str, art: dict) -> None:
        with self._lock:
            rec = self._jobs[job_id]
            rec["artifacts"] = [a for a in rec["artifacts"] if a["name"] != art["name"]] + [art]
            rec["updated_at"] = now_iso()
            self.store.save(rec)

    def _write_manifest(self, rec: dict, stage: Stage, inputs: dict, metrics: dict) -> Path:
        run_dir = Path(rec["run_dir"])
        arts = []
        for art in rec["artifacts"]:
            path = run_dir / art["path"]
            if not path.exists():
                raise FileNotFoundError(f"artifact {art['name']!r} is missing: {path}")
            digest = sha256_tree(path)  # re-hashed: the manifest vouches for the files as they are now
            arts.append({"name": art["name"], "path": art["path"], "sha256": digest})
        with self._lock:
            rec["artifacts"] = arts
        manifest = {
            "format": 1, "stage": stage.name, "job_id": rec["job_id"], "config": rec["config"], "inputs": inputs,
            "code_version": code_version(), "metrics": _jsonable(metrics), "artifacts": arts,
            "started_at": rec["started_at"], "finished_at": now_iso(), "attempts": rec["attempts"],
            "resumed_from_step": rec.get("resumed_from_step"),
        }
        return self.store.write_manifest(rec["job_id"], manifest)


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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return json.loads(json.dumps(obj, default=str))
