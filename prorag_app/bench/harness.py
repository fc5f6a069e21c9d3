"""What every benchmark shares: service processes on free loopback ports, percentiles and medians of repeated
runs, and the description of the machine and its load that goes into each result."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys

from prorag_app import procs
from prorag_app.stack import pick_port


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct loopback ports nothing listens on now, drawn at random below the ephemeral range
    (prorag_app.stack.pick_port). Not a scan from a fixed start: make test's two workers once ran two benches whose
    servers scanned from the same start, and one bench's calls reached the other's server."""
    taken: set[int] = set()
    for _ in range(n):
        taken.add(pick_port("127.0.0.1", taken))
    return sorted(taken)


def serve(service: str, port: int, sets: dict, log_path=None, extra_args=(), http_port: int = -1,
          env: dict | None = None) -> subprocess.Popen:
    """``prorag serve <service>`` on ``port`` (HTTP on ``http_port``, -1 = none) with ``--set`` ``sets``, any
    ``extra_args`` (serve flags such as ``--max-concurrent-rpcs``, ``--metrics-port``) and ``env`` (default: this
    process's)."""
    cmd = [sys.executable, "-m", "prorag_app.cli", "serve", service, "--port", str(port), "--http-port",
           str(http_port), *extra_args]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # procs.spawn: stopped with the bench, even a killed one (a timeout's SIGTERM used to leave it serving)
    return procs.spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop(*started) -> None:
    procs.stop(started)  # SIGTERM, then SIGKILL after procs.STOP_TIMEOUT_S; reaped


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank below)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def median_dicts(runs: list[dict]) -> dict:
    """Per key, the median over repeated runs of the same measurement."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def load_average() -> list[float]:
    """The machine's 1/5/15-minute load average (empty where the platform has none): other load skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> str:
    return " ".join(x for x in (platform.machine(), platform.processor(), f"cpus={os.cpu_count()}") if x)
