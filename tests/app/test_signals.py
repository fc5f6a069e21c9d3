"""A `prorag` command that is stopped stops every process it started (issue 31 item 4).

`prorag up`, `prorag bench policy` and `prorag run --profile tiny` are started as users start them, and once their
service processes listen, stopped with SIGTERM or SIGKILL (nothing runs in the command then: the kernel's
PR_SET_PDEATHSIG stops the servers); SIGINT (what Ctrl-C sends the command: its servers are in sessions of their own,
out of the terminal's reach) takes the same handler, tested on a small command. Then every process the command started
must be gone and every port they listened on closed. Processes and ports are read from /proc, so the test trusts no
bookkeeping of the code under test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prorag import paths
from tests.helpers import env as env_var
from tests.helpers import free_offset, tiny_data

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


# ---------------------------------------------------------------- /proc
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every living process under ``pid``, at any depth."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and st[0] != "Z":
                parents.setdefault(st[1], []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # a zombie serves nothing; whoever adopted it reaps it


def listening_ports(pids) -> set[int]:
    """TCP ports in LISTEN state whose socket one of ``pids`` holds."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                inodes[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                ports.add(inodes[target[8:-1]])
    return ports


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(cond, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"not within {timeout:.0f} s: {what}\n{tail}")


# ---------------------------------------------------------------- the mechanism, cheaply
def _script(tmp_path: Path, body: str) -> subprocess.Popen:
    path = tmp_path / "cmd.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


SLEEPER = "[sys.executable, '-c', 'import time; time.sleep(600)']"
STUBBORN = ("[sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(1, flush=True); time.sleep(600)']")


def test_a_child_spawned_from_a_worker_thread_outlives_that_thread():
    """PR_SET_PDEATHSIG follows the forking *thread*: the pipeline starts stacks in a thread pool, and those
    servers must live until they are stopped, not until the thread that asked for them ends."""
    from prorag_app import procs

    box = []
    t = threading.Thread(target=lambda: box.append(procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"])))
    t.start()
    t.join()
    try:
        time.sleep(1.0)  # the death signal, were it tied to the thread, is sent at once
        assert box[0].poll() is None and box[0] in procs.live()
    finally:
        procs.stop([box[0]], timeout=5)
    assert box[0].poll() is not None and box[0] not in procs.live()


def test_sigkill_of_the_command_stops_what_it_spawned(tmp_path):
    cmd = _script(tmp_path, f"""
        import sys, time
        from prorag_app import procs
        print(procs.spawn({SLEEPER}).pid, flush=True)
        time.sleep(600)
    """)
    try:
        child = int(cmd.stdout.readline())
        assert alive(child) and child in descendants(cmd.pid)
        cmd.kill()
        cmd.wait(10)
        wait_until(lambda: not alive(child), 30, f"pid {child} gone after its parent was SIGKILLed")
    finally:
        cmd.kill()
        cmd.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_the_command_and_kills_a_child_that_ignores_sigterm(tmp_path, sig):
    cmd = _script(tmp_path, f"""
        import sys, time
        from prorag_app import procs
        procs.install_signal_handlers(grace=2.0)
        p = procs.spawn({STUBBORN}, stdout=sys.stdout)
        print(p.pid, flush=True)
        try:
            time.sleep(600)
        except procs.Stopped as e:
            sys.exit(128 + e.signum)
    """)
    try:
        child = int(cmd.stdout.readline())
        assert cmd.stdout.readline().strip() == "1"  # its SIGTERM handler is set: it would ignore a plain stop
        cmd.send_signal(sig)
        assert cmd.wait(60) == 128 + sig
        wait_until(lambda: not alive(child), 30, f"pid {child} (ignoring SIGTERM) killed after the grace period")
    finally:
        cmd.kill()
        cmd.wait(10)


# ---------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One PRORAG_HOME with the tiny world, its indexes and base policy, shared by the commands below (each then
    starts its services without building anything)."""
    root = tmp_path_factory.mktemp("home")
    # the worker's copy (tests.helpers.tiny_data) in PRORAG_HOME/data, the data directory of the commands' _env;
    # ensure_* then find it complete, as the commands do
    tiny_data(root / "data")
    with env_var("PRORAG_DATA", str(root / "data")):
        from prorag_app.embedded import ensure_indexes, ensure_policy_model

        ensure_indexes("tiny")
        ensure_policy_model("tiny")
    return root


def _env(home: Path) -> dict:
    env = dict(os.environ, PRORAG_HOME=str(home), PRORAG_TRACKING="local", PYTHONUNBUFFERED="1")
    for k in ("PRORAG_DATA", "PRORAG_RUNS", "PRORAG_TLS_CERT", "PRORAG_TLS_KEY", "PRORAG_AUTH_TOKENS",
              "PRORAG_TLS_CA", "PRORAG_TOKEN_FILE"):
        env.pop(k, None)
    return env


def _stop_and_check(args: list[str], home: Path, tmp_path: Path, sig: int, servers: int, expect_code: int | None,
                    serving_timeout: float = 300) -> None:
    """Start ``prorag ARGS``; once ``servers`` processes under it listen, send ``sig`` to the command alone; then
    every process it started is gone and every port they listened on is closed."""
    log = tmp_path / "cmd.log"
    with open(log, "w") as out:
        cmd = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", *args], cwd=REPO, env=_env(home),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started: set[int] = set()
    ports: set[int] = set()
    try:
        def serving() -> bool:
            assert cmd.poll() is None, f"prorag {args[0]} ended early ({cmd.returncode}): " + log.read_text()[-3000:]
            kids = descendants(cmd.pid)
            started.update(kids)
            with_ports = [k for k in kids if listening_ports([k])]
            if len(with_ports) < servers:
                return False
            ports.update(listening_ports(kids))
            return all(port_open(p) for p in ports)

        wait_until(serving, serving_timeout, f"{servers} service processes of prorag {args[0]} listening", log)
        started.update(descendants(cmd.pid))
        assert started and ports
        cmd.send_signal(sig)
        code = cmd.wait(90)
        if expect_code is not None:
            assert code == expect_code, log.read_text()[-3000:]
        wait_until(lambda: not any(alive(p) for p in started), 60,
                   f"every process prorag {args[0]} started gone after {signal.Signals(sig).name}: "
                   f"{sorted(p for p in started if alive(p))}", log)
        wait_until(lambda: not any(port_open(p) for p in ports), 30, f"ports {sorted(ports)} closed", log)
    finally:
        for p in [cmd.pid, *started]:  # whatever the outcome, leave nothing behind
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        cmd.wait(30)


# `prorag up` stopped by SIGTERM: tests/app/test_cli_up.py (each service's port stops answering, exit code 0)
def test_up_killed_with_sigkill_takes_its_services_with_it(home, tmp_path):
    off = free_offset()
    _stop_and_check(["up", "--world", "tiny", "--port-offset", str(off)], home, tmp_path, signal.SIGKILL,
                    servers=len(paths.SERVICES), expect_code=-signal.SIGKILL)


def test_up_stopped_by_sigterm_while_still_starting_stops_what_it_started_and_exits_0(home, tmp_path):
    """`docker stop` does not wait for readiness: SIGTERM once the first service listens, the others still
    loading, ends `up` as a stop while serving does."""
    off = free_offset()
    _stop_and_check(["up", "--world", "tiny", "--port-offset", str(off)], home, tmp_path, signal.SIGTERM,
                    servers=1, expect_code=0)


def test_bench_policy_stopped_by_sigterm(home, tmp_path):
    """What a timeout's SIGTERM left serving for 23 minutes."""
    _stop_and_check(["bench", "policy", "--world", "tiny", "--model", "base", "--questions", "4", "--samples", "4",
                     "--repeats", "3", "--json"], home, tmp_path, signal.SIGTERM, servers=2,
                    expect_code=128 + signal.SIGTERM)


def test_run_stopped_by_sigterm_while_its_services_are_up(home, tmp_path):
    off = free_offset()
    _stop_and_check(["run", "--profile", "tiny", "--port-offset", str(off)], home, tmp_path, signal.SIGTERM,
                    servers=len(paths.SERVICES), expect_code=128 + signal.SIGTERM)
