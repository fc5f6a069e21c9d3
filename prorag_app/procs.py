"""The processes a `prorag` command starts, and stopping every one of them when the command stops.

Why (issue 31): `prorag bench policy` killed by a timeout left its retriever and policy servers serving 23 minutes
later. Python's default SIGTERM ends a process without running a ``finally`` or ``atexit``, and the servers run in
sessions of their own. So every service process goes through :func:`spawn`, which gives it

- its own session: a terminal's Ctrl-C reaches only the command, which stops its children in order;
- PR_SET_PDEATHSIG (Linux): the kernel sends it SIGTERM when the command dies, a SIGKILL of the command included;
- a place in a registry that :func:`stop_all` empties, at exit and on the command's first SIGTERM or SIGINT
  (:func:`install_signal_handlers`: the signal becomes :class:`Stopped`, so ``with`` blocks stop their stacks; a
  watchdog SIGKILLs what is left after a grace period and ends the command if it is still unwinding).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("prorag.procs")

#: seconds a service gets between SIGTERM and SIGKILL (the trainer checkpoints in that time)
STOP_TIMEOUT_S = 15.0
PR_SET_PDEATHSIG = 1

_lock = threading.RLock()  # re-entered by the signal handler when it interrupts a holder
_live: dict[int, subprocess.Popen] = {}
_stopping_signal = 0  # the signal that started a stop, 0 while none did


class Stopped(KeyboardInterrupt):
    """The command got SIGTERM or SIGINT. A KeyboardInterrupt, so code that tidies up after a Ctrl-C does the
    same here, and no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# resolved here, once: the child between fork and exec must not load libraries or take locks
_PRCTL = _load_prctl()
_SIGTERM = int(signal.SIGTERM)


def _in_child(parent_pid: int) -> None:
    """Runs in the new process before exec."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, _SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the command died before prctl took effect: nothing would stop us
            os._exit(1)


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a stack started in a
# worker thread (the pipeline evaluates methods in a thread pool) would lose its servers when that thread is
# done. So processes are forked by the main thread, or by one daemon thread that lives as long as the process.
_requests: queue.Queue = queue.Queue()
_forker: threading.Thread | None = None


def _forker_loop() -> None:
    while True:
        fn, box, done = _requests.get()
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the thread that asked
            box.append(e)
        done.set()


def _fork_from_long_lived_thread(fn):
    global _forker
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _lock:
        if _forker is None or not _forker.is_alive():
            _forker = threading.Thread(target=_forker_loop, name="prorag-spawn", daemon=True)
            _forker.start()
    box: list = []
    done = threading.Event()
    _requests.put((fn, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def spawn(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` in its own session, stopped with this process (see the module)."""
    popen_kwargs.setdefault("start_new_session", True)
    popen_kwargs["preexec_fn"] = functools.partial(_in_child, os.getpid())
    proc = _fork_from_long_lived_thread(lambda: subprocess.Popen(cmd, **popen_kwargs))
    with _lock:
        _live[proc.pid] = proc
        stopping = _stopping_signal
    if stopping:  # started while the command is stopping: it must not outlive it
        stop([proc], timeout=2.0)
    return proc


def live() -> list[subprocess.Popen]:
    """The processes spawned here that have not been stopped (some may have exited on their own)."""
    with _lock:
        return list(_live.values())


def _signal_all(procs, sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass


def stop(procs, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each of ``procs``, wait for them until ``timeout`` seconds from now, SIGKILL the rest; each is
    reaped and leaves the registry."""
    procs = list(procs)
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s of SIGTERM; killing it", p.pid, timeout)
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep): the kernel reaps it later
                log.error("pid %d survived SIGKILL for 10 s", p.pid)
        with _lock:
            _live.pop(p.pid, None)


def stop_all(timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop every process spawned here and not stopped yet."""
    procs = live()
    if procs:
        stop(procs, timeout)


atexit.register(stop_all)


def _watchdog(signum: int, grace: float) -> None:
    """After a stop signal: SIGKILL whatever child is left after ``grace`` seconds, and end the command if it is
    still unwinding (a worker thread that does not notice, a call without a deadline) 10 seconds later."""
    time.sleep(grace)
    left = [p for p in live() if p.poll() is None]
    if left:
        log.warning("still running %.0f s after %s: killing %s", grace, signal.Signals(signum).name,
                    [p.pid for p in left])
        _signal_all(left, signal.SIGKILL)
    time.sleep(10.0)
    print(f"prorag: still not stopped {grace + 10:.0f} s after {signal.Signals(signum).name}; exiting",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _on_signal(signum, frame, grace: float) -> None:
    global _stopping_signal
    with _lock:
        first = not _stopping_signal
        _stopping_signal = _stopping_signal or signum
    if not first:  # asked twice: no more patience
        _signal_all(live(), signal.SIGKILL)
        os._exit(128 + signum)
    # the children start stopping now, whatever the main thread is in the middle of; the unwinding ``with`` blocks
    # and atexit wait for them
    _signal_all(live(), signal.SIGTERM)
    threading.Thread(target=_watchdog, args=(signum, grace), name="prorag-stop-watchdog", daemon=True).start()
    raise Stopped(signum)


def install_signal_handlers(grace: float = STOP_TIMEOUT_S + 5.0) -> None:
    """SIGTERM and SIGINT stop the command and every process it spawned (main thread only)."""
    handler = functools.partial(_on_signal, grace=grace)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
