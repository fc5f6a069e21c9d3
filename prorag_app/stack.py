"""Run the five services as local processes (what `prorag up` and `prorag run` share)."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from prorag import paths
from prorag.rpc.clients import wait_for_health
from prorag_app import procs as _procs  # aliased: the stack has a field named procs


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


@dataclass
class ServiceStack:
    host: str = "127.0.0.1"
    port_offset: int = 0
    world: str = "default"
    services: tuple[str, ...] = paths.SERVICES
    start_timeout: float = 180.0
    overrides: dict[str, dict] = field(default_factory=dict)  # service -> {setting: value} (--set)
    log_dir: str | None = None  # each service's output goes to <log_dir>/<service>.log when set
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def grpc_target(self, svc: str) -> str:
        return f"{self.host}:{paths.GRPC_PORTS[svc] + self.port_offset}"

    def http_url(self, svc: str) -> str:
        return f"http://{self.host}:{paths.HTTP_PORTS[svc] + self.port_offset}"

    def start(self) -> "ServiceStack":
        busy = [p for svc in self.services for p in
                [paths.GRPC_PORTS[svc] + self.port_offset, paths.METRICS_PORTS[svc] + self.port_offset]
                + ([paths.HTTP_PORTS[svc] + self.port_offset] if svc in paths.HTTP_PORTS else [])
                if not port_free(self.host, p)]
        if busy:
            raise SystemExit(f"ports already in use on {self.host}: {busy}; is another `prorag up` running? "
                             f"Use --port-offset N to shift every port.")
        try:
            self._spawn_and_wait()
        except BaseException:  # Ctrl-C or SIGTERM while starting too: __exit__ does not run when __enter__ raises
            self.stop()
            raise
        return self

    def _spawn_and_wait(self) -> None:
        for svc in self.services:
            cmd = [sys.executable, "-m", "prorag_app.cli", "serve", svc, "--host", self.host,
                   "--port", str(paths.GRPC_PORTS[svc] + self.port_offset), "--port-offset", str(self.port_offset),
                   "--metrics-port", str(paths.METRICS_PORTS[svc] + self.port_offset)]
            if svc in paths.HTTP_PORTS:
                cmd += ["--http-port", str(paths.HTTP_PORTS[svc] + self.port_offset)]
            if svc in ("retriever", "policy", "judge", "prm"):  # the prm: where a name@version is looked up
                cmd += ["--set", f"world={self.world}"]
            for k, v in self.overrides.get(svc, {}).items():
                cmd += ["--set", f"{k}={v}"]
            out = None
            if self.log_dir:
                Path(self.log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(self.log_dir) / f"{svc}.log", "ab")
            # _procs.spawn: stopped with this process, even a SIGKILLed one (prorag_app.procs)
            self.procs[svc] = _procs.spawn(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
            if out is not None:
                out.close()  # the child holds its own copy
        for svc in self.services:
            if not wait_for_health(self.grpc_target(svc), "", timeout=self.start_timeout):
                code = self.procs[svc].poll()
                raise SystemExit(f"{svc} did not become live on {self.grpc_target(svc)} within "
                                 f"{self.start_timeout:.0f}s (exit code {code}){self.log_tail(svc)}")

    def log_tail(self, svc: str, lines: int = 30) -> str:
        """The last ``lines`` lines of ``svc``'s log file as a block to append to an error ('' without a log): a
        service that dies at start on a remote machine then says why in the error itself."""
        if not self.log_dir:
            return ""
        log = Path(self.log_dir) / f"{svc}.log"
        try:
            text = log.read_bytes()[-64 * 1024:].decode("utf-8", "replace")
        except OSError as e:
            return f"; its log {log} could not be read: {e}"
        tail = "\n".join(text.rstrip().splitlines()[-lines:])
        return f"; the last lines of {log}:\n{tail}" if tail else f"; its log {log} is empty"

    def dead(self) -> list[tuple[str, int]]:
        return [(svc, p.returncode) for svc, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout: float = _procs.STOP_TIMEOUT_S) -> None:
        _procs.stop(self.procs.values(), timeout)  # SIGTERM, wait until the deadline, SIGKILL the rest
        self.procs.clear()

    def __enter__(self) -> "ServiceStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OnDemand:
    """A stack that serves trainer jobs, started by the first :meth:`need` (just before a job that samples through
    it is submitted) rather than on entry, and stopped on exit when it was started. Its targets are known before:
    they follow from its port offset. A run whose jobs are all finished, and reused, then starts none of its
    processes (each one a model load and ~4-10 s of imports, for nothing)."""

    def __init__(self, stack: ServiceStack):
        self.stack, self.started = stack, False

    def grpc_target(self, svc: str) -> str:
        return self.stack.grpc_target(svc)

    def need(self) -> None:
        if not self.started:
            self.stack.__enter__()
            self.started = True

    def __enter__(self) -> "OnDemand":
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            self.started = False
            self.stack.__exit__(*exc)
