"""prorag_app.stack: a service run as several local processes behind one round-robin target (the policy replicas
`prorag run` samples stages 2-4 from), started, reached and stopped like a single one."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from prorag.errors import Unavailable
from prorag.rpc.clients import PolicyClient, resolve_replicas
from prorag.rpc.clients_trainer import TrainerClient
from prorag_app.stack import LOCAL_PORTS, ServiceStack, cpu_cores, pick_port, port_free, replica_port
from prorag_app.trainer_jobs import trainer_gone
from tests.helpers import env, free_offset


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_a_replicated_policy_runs_as_processes_behind_one_round_robin_target(tiny_policy, tmp_path):
    policy_dir, _ = tiny_policy
    offset = free_offset()
    stack = ServiceStack(world="tiny", services=("policy",), port_offset=offset, start_timeout=120,
                         log_dir=str(tmp_path / "logs"), replicas={"policy": 2},
                         overrides={"policy": {"model": str(policy_dir), "device": "cpu", "restore_active": "false",
                                               "compile_decode": "off", "retriever": "127.0.0.1:1"}})
    target = stack.grpc_target("policy")
    first, second = resolve_replicas(target)
    # the first on the documented port shifted by the offset, the other drawn below the ephemeral range
    assert target.startswith("ipv4:") and first == f"127.0.0.1:{50052 + offset}"
    assert LOCAL_PORTS[0] <= int(second.rsplit(":", 1)[1]) < LOCAL_PORTS[1]
    with stack:
        procs = dict(stack.procs)
        assert set(procs) == {"policy", "policy-1"} and not stack.dead()
        threads = str(max(1, cpu_cores() // 2))  # the cores shared out between the two
        assert [_environ(p.pid).get("OMP_NUM_THREADS") for p in procs.values()] == [threads, threads]
        with PolicyClient(target, timeout=60) as c:
            # round robin picks among the connections that are up: a loaded machine may connect the second a
            # moment after the first calls went out, so call until both answered (or the bound runs out)
            served_by, deadline = set(), time.monotonic() + 60
            while len(served_by) < 2 and time.monotonic() < deadline:
                served_by.add(c.model_info().extra["replica"])
        assert len(served_by) == 2, served_by
    assert all(p.poll() is not None for p in procs.values())  # stopping the stack stops every replica
    assert {f.name for f in (tmp_path / "logs").iterdir()} == {"policy.log", "policy-1.log"}


def test_a_single_process_service_keeps_its_documented_target():
    stack = ServiceStack(services=("retriever", "policy"), port_offset=7, replicas={"policy": 1})
    assert stack.grpc_target("policy") == "127.0.0.1:50059" and stack.replica_ports == {}


@pytest.mark.parametrize("kwargs, fragment", [
    ({"replicas": {"policy": 0}}, "at least 1"),
    ({"replicas": {"prm": 2}}, "not one of this stack's services"),
    ({"replicas": {"policy": 2}, "host": "localhost"}, "IPv4 address"),
])
def test_replicas_are_checked_when_the_stack_is_made(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServiceStack(services=("policy",), **kwargs)


def test_picked_ports_are_free_distinct_and_inside_the_span():
    taken: set[int] = set()
    for _ in range(5):
        port = pick_port("127.0.0.1", taken)
        assert LOCAL_PORTS[0] <= port < LOCAL_PORTS[1] and port not in taken
        taken.add(port)
    with pytest.raises(SystemExit, match="no free port"):
        pick_port("127.0.0.1", taken={25_000}, span=(25_000, 25_001))


def test_a_stack_made_again_with_the_same_offset_gives_its_replicas_the_same_ports():
    """A run restarted after a crash starts its stack again: the trainer job it resumes keeps the addresses it was
    submitted with, so the replicas must come back where they were."""
    offset = free_offset()
    preferred = [replica_port("policy", offset, r) for r in (1, 2)]
    free = all(port_free("127.0.0.1", p) for p in preferred)  # another test's server may hold one, rarely
    first = ServiceStack(services=("policy",), port_offset=offset, replicas={"policy": 3})
    again = ServiceStack(services=("policy",), port_offset=offset, replicas={"policy": 3})
    assert first.grpc_target("policy") == again.grpc_target("policy") or not free
    assert first.replica_ports["policy"] == preferred or not free
    other = ServiceStack(services=("policy",), port_offset=offset + 1, replicas={"policy": 3})
    assert other.replica_ports["policy"] != first.replica_ports["policy"]  # another run's stack, other ports


def test_a_busy_preferred_port_is_passed_over_for_a_free_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        port = pick_port("127.0.0.1", span=(1024, 65_536), preferred=busy)
    assert port != busy and 1024 <= port < 65_536
    assert pick_port("127.0.0.1", preferred=LOCAL_PORTS[0] + 5, taken={LOCAL_PORTS[0] + 5}) != LOCAL_PORTS[0] + 5


def test_a_watch_on_the_stacks_own_trainer_ends_saying_why_once_its_process_is_killed(tmp_path):
    """`prorag run` watches its jobs on the trainer its own stack started, which nothing restarts: a trainer
    killed under it (the kernel's out-of-memory killer sends SIGKILL) ends the watch with Unavailable saying how,
    where the watch used to wait for ever for a trainer to come back."""
    with env("PRORAG_HOME", str(tmp_path / "home")), env("PRORAG_RUNS", str(tmp_path / "home" / "runs")):
        stack = ServiceStack(services=("trainer",), port_offset=free_offset(), start_timeout=120,
                             log_dir=str(tmp_path / "logs"))
        with stack, TrainerClient(stack.grpc_target("trainer"), timeout=30) as client:
            assert stack.exit_message("trainer") is None and stack.exit_message("policy") is None
            client.start("selftest", {"steps": 100_000, "step_sleep_s": 0.01, "log_every": 10,
                                      "tracking": "local"}, job_id="long")
            events = client.watch("long", gone=trainer_gone(stack))
            next(events)  # the stream is open
            ended: list[BaseException] = []

            def drain() -> None:
                try:
                    for _ in events:
                        pass
                except BaseException as exc:  # noqa: BLE001 - checked below, in the test's thread
                    ended.append(exc)

            os.kill(stack.procs["trainer"].pid, signal.SIGKILL)
            watcher = threading.Thread(target=drain, daemon=True)
            watcher.start()
            watcher.join(120)  # a guard against a hang, not a timing claim: without gone() the watch never ends
            assert not watcher.is_alive(), "the watch still waits for a trainer that nothing starts again"
    assert len(ended) == 1 and isinstance(ended[0], Unavailable), ended
    message = str(ended[0])
    assert "watching job long" in message and "killed by SIGKILL" in message and "out-of-memory" in message
    assert "trainer.log" in message and "run the same command again" in message
