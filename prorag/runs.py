"""Run directories: runs/<timestamp>-<name>/ with results.json, and runs/latest pointing at the newest."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from prorag import paths
from prorag.io import write_json


def code_version() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent.parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def new_run_dir(name: str) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    d = paths.runs_dir() / f"{stamp}-{name}"
    n = 1
    while d.exists():
        n += 1
        d = paths.runs_dir() / f"{stamp}-{name}-{n}"
    d.mkdir(parents=True)
    return d


def point_latest(run_dir: Path) -> Path:
    """Atomically repoint runs/latest at ``run_dir`` (symlink swap by rename)."""
    latest = paths.runs_dir() / "latest"
    tmp = paths.runs_dir() / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, latest)
    return latest


def write_results(run_dir: Path, results: dict) -> Path:
    write_json(run_dir / "results.json", results)
    point_latest(run_dir)
    return run_dir / "results.json"


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Records under ``timings[name]`` the seconds the block took (monotonic clock), once it completes: the
    phases of a run in results.json's "timings"."""
    start = time.monotonic()
    yield
    timings[name] = time.monotonic() - start
