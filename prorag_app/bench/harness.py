"""What every benchmark shares: service processes on free loopback ports, percentiles and medians of repeated
runs, and the description of the machine and its load that goes into each result."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys

from prorag_app import procs
from prorag_app.stack import port_free


def free_port(start: int) -> int:
    """The first free loopback port from ``start`` up."""
    port = start
    while not port_free("127.0.0.1", port):
        port += 1
    return port


def os_port() -> int:
    """A loopback port the OS says is free now (bound to port 0, then released). Unlike :func:`free_port`'s scan from
    a fixed start, two processes asking at once get different ports: make test's two workers each ran a load bench
    whose servers scanned from the same start, and one bench's calls reached the other's server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
