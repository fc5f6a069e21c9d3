"""The files of every job under a jobs root; no caching, no locking of records (the manager does both)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from prorag.errors import FailedPrecondition
from prorag.io import atomic_dir, write_json
from services.trainer.jobs.record import Job, now_iso

log = logging.getLogger("prorag.trainer.jobs")

LOCK_NAME = ".trainer.lock"


class JobStore:
    """Files of every job under ``root``."""

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

    def create(self, job: Job, first_event: dict) -> None:
        """The job's directory with job.json and its first event appears in one rename."""
        with atomic_dir(self.job_dir(job.job_id)) as tmp:
            write_json(tmp / "job.json", job.to_dict())
            with open(tmp / "events.jsonl", "w") as fh:
                fh.write(json.dumps(first_event, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def save(self, job: Job) -> None:
        write_json(self.job_dir(job.job_id) / "job.json", job.to_dict())

    def load(self, job_id: str) -> Job:
        return Job.from_dict(json.loads((self.job_dir(job_id) / "job.json").read_text()))

    def load_all(self) -> list[Job]:
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
