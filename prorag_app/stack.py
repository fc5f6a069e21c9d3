"""Run the five services as local processes (what `prorag up` and `prorag run` share)."""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

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


#: where the ports of local processes with no documented port are drawn (a service's extra replicas, the benches'
#: servers): below the kernel's ephemeral range (32768-60999 on Linux), where an outgoing connection could take a
#: port between its check and the process's bind, and above the documented ports shifted by the offsets of runs and
#: of the test suite (their HTTP and metrics ports reach ~25,000)
LOCAL_PORTS = (25_000, 32_768)


def pick_port(host: str, taken: set[int] = frozenset(), span: tuple[int, int] = LOCAL_PORTS,
              preferred: int | None = None) -> int:
    """A port in [span) that nothing on ``host`` listens on now and that is not in ``taken``: ``preferred`` when it
    is one, else drawn at random, so two stacks picking at once rarely meet (the bind check catches the rest)."""
    if preferred is not None and span[0] <= preferred < span[1] and preferred not in taken \
            and port_free(host, preferred):
        return preferred
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*span)
        if port not in taken and port_free(host, port):
            return port
    raise SystemExit(f"no free port on {host} in {span[0]}-{span[1] - 1}")


def replica_port(svc: str, port_offset: int, replica: int) -> int:
    """The gRPC port replica ``replica`` (1, 2, ...) of ``svc`` asks for first: a function of the service, the
    offset and the replica alone. Why: a stack started again with the same offset (a run restarted after a crash or
    a machine stop) gets the same addresses, and the trainer job it resumes, which keeps the addresses it was
    submitted with, reaches every replica again instead of only the first."""
    return LOCAL_PORTS[0] + zlib.crc32(f"{svc}/{port_offset}/{replica}".encode()) % (LOCAL_PORTS[1] - LOCAL_PORTS[0])


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_policy_replicas() -> int:
    """Policy processes for the stacks that sample from one model at length (MCTS, the sibling sampler, RFT, the RL
    pool and rollouts): on a CPU host one per core up to 4, each on its share of the cores, since one process of the
    small embedded policy keeps ~1.5 of 2 cores busy and two replicas of one thread gave 1.52x the rollouts of one
    process of two (docs/BENCHMARKS.md, "Thirty-ninth session"); on a GPU host one (replicas would each hold the
    model on the same device)."""
    # here, not at the top: `prorag up` and the benches load this module too, and need no torch in their process
    import torch

    return 1 if torch.cuda.is_available() else max(1, min(cpu_cores(), 4))


class _Process(NamedTuple):
    name: str  # the service's, or a replica's: policy-1
    service: str
    grpc_port: int
    args: list[str]  # its `prorag serve` arguments after the service: its ports
    env: dict | None  # its environment, or None for this process's


@dataclass
class ServiceStack:
    host: str = "127.0.0.1"
    port_offset: int = 0
    world: str = "default"
    services: tuple[str, ...] = paths.SERVICES
    start_timeout: float = 180.0
    overrides: dict[str, dict] = field(default_factory=dict)  # service -> {setting: value} (--set)
    log_dir: str | None = None  # each service's output goes to <log_dir>/<service>.log when set
    #: processes per service (default 1). The first listens on the service's documented ports shifted by
    #: port_offset; each other one on a gRPC port in LOCAL_PORTS (replica_port's when free), its metrics on any free
    #: port and without the HTTP front. grpc_target then names them all as an ipv4: list, which the clients balance
    #: round-robin, and each process gets the cores' share of torch threads (OMP_NUM_THREADS).
    replicas: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # process name (policy, policy-1, ...) -> it
    #: service -> the gRPC ports of its replicas after the first, drawn when the stack is made: its targets are
    #: known before it starts (prorag_app.stack.OnDemand)
    replica_ports: dict[str, list[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        taken: set[int] = set()
        for svc, n in self.replicas.items():
            if svc not in self.services:
                raise ValueError(f"replicas: {svc!r} is not one of this stack's services {self.services}")
            if n < 1:
                raise ValueError(f"replicas: {svc} needs at least 1 process, got {n}")
            if n > 1:
                try:
                    ipaddress.IPv4Address(self.host)
                except ValueError:
                    raise ValueError(f"replicas: the clients reach {n} {svc} processes through an ipv4: address "
                                     f"list, so the stack's host must be an IPv4 address, not {self.host!r}") from None
                ports = [pick_port(self.host, taken, preferred=replica_port(svc, self.port_offset, r))
                         for r in range(1, n)]
                taken.update(ports)
                self.replica_ports[svc] = ports

    def _grpc_port(self, svc: str) -> int:
        return paths.GRPC_PORTS[svc] + self.port_offset

    def grpc_target(self, svc: str) -> str:
        """The address clients of ``svc`` use: host:port, or ``ipv4:host:p0,host:p1,...`` for a replicated one."""
        extra = self.replica_ports.get(svc, [])
        if not extra:
            return f"{self.host}:{self._grpc_port(svc)}"
        return "ipv4:" + ",".join(f"{self.host}:{p}" for p in [self._grpc_port(svc), *extra])

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

    def _processes(self) -> list[_Process]:
        """Every process the stack runs, in start order."""
        out = []
        for svc in self.services:
            extra = self.replica_ports.get(svc, [])
            env = None
            if extra:  # the cores shared out: each replica's torch threads
                threads = str(max(1, cpu_cores() // (len(extra) + 1)))
                env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
            ports = ["--port", str(self._grpc_port(svc)),
                     "--metrics-port", str(paths.METRICS_PORTS[svc] + self.port_offset)]
            if svc in paths.HTTP_PORTS:
                ports += ["--http-port", str(paths.HTTP_PORTS[svc] + self.port_offset)]
            out.append(_Process(svc, svc, self._grpc_port(svc), ports, env))
            for r, port in enumerate(extra, start=1):
                out.append(_Process(f"{svc}-{r}", svc, port,
                                    ["--port", str(port), "--metrics-port", "0", "--http-port", "-1"], env))
        return out

    def _spawn_and_wait(self) -> None:
        processes = self._processes()
        for name, svc, _, ports, env in processes:
            cmd = [sys.executable, "-m", "prorag_app.cli", "serve", svc, "--host", self.host, *ports,
                   "--port-offset", str(self.port_offset)]
            if svc in ("retriever", "policy", "judge", "prm"):  # the prm: where a name@version is looked up
                cmd += ["--set", f"world={self.world}"]
            for k, v in self.overrides.get(svc, {}).items():
                cmd += ["--set", f"{k}={v}"]
            out = None
            if self.log_dir:
                Path(self.log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(self.log_dir) / f"{name}.log", "ab")
            # _procs.spawn: stopped with this process, even a SIGKILLed one (prorag_app.procs)
            self.procs[name] = _procs.spawn(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
            if out is not None:
                out.close()  # the child holds its own copy
        for name, _, grpc_port, _, _ in processes:
            target = f"{self.host}:{grpc_port}"
            if not wait_for_health(target, "", timeout=self.start_timeout):
                code = self.procs[name].poll()
                raise SystemExit(f"{name} did not become live on {target} within "
                                 f"{self.start_timeout:.0f}s (exit code {code}){self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` lines of process ``name``'s log file (a service, or a replica: policy-1) as a block to
        append to an error ('' without a log): a service that dies at start on a remote machine then says why in
        the error itself."""
        if not self.log_dir:
            return ""
        log = Path(self.log_dir) / f"{name}.log"
        try:
            text = log.read_bytes()[-64 * 1024:].decode("utf-8", "replace")
        except OSError as e:
            return f"; its log {log} could not be read: {e}"
        tail = "\n".join(text.rstrip().splitlines()[-lines:])
        return f"; the last lines of {log}:\n{tail}" if tail else f"; its log {log} is empty"

    def exit_message(self, name: str) -> str | None:
        """None while process ``name`` (a service, or a replica: policy-1) runs or is not this stack's; once it has
        exited, how (its exit code, or the signal that ended it) with its log's last lines."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        if code >= 0:
            return f"its process exited with code {code}{self.log_tail(name)}"
        how = f"its process was killed by {signal.Signals(-code).name}"
        if code == -signal.SIGKILL:
            how += " (what the kernel's out-of-memory killer sends: `dmesg` says whether it did)"
        return how + self.log_tail(name)

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
