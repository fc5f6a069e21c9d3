"""Typed client for the Trainer service: start, watch (re-watching across trainer restarts), cancel, get, list, wait."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import grpc

from prorag.errors import Unavailable
from prorag.rpc.clients import FAST_RECONNECT, channel
from prorag.pb import trainer_pb2, trainer_pb2_grpc

MiB = 1024 * 1024
TERMINAL_STATES = frozenset({trainer_pb2.JOB_STATE_SUCCEEDED, trainer_pb2.JOB_STATE_FAILED,
                             trainer_pb2.JOB_STATE_CANCELLED})


def state_name(state: int) -> str:
    """JOB_STATE_SUCCEEDED -> "SUCCEEDED"."""
    return trainer_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


class TrainerClient:
    """``with TrainerClient("127.0.0.1:50055") as tc: job = tc.start("selftest", {"steps": 100});
    tc.wait(job.job_id)``"""

    def __init__(self, target: str, timeout: float = 30.0, max_message_mb: int = 64,
                 reconnect_backoff_s: float = 0.5, wait_for_ready: bool = False):
        """wait_for_ready: unary calls wait, within their deadline, for a trainer that cannot be reached yet
        (restarting, or too loaded to finish a connection) instead of failing at once with UNAVAILABLE; for
        callers that own the trainer and would rather wait than stop (the pipeline). Every unary call is
        idempotent (StartJob with a job_id included), so waiting never runs anything twice."""
        self.target = target
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self.reconnect_backoff_s = reconnect_backoff_s
        # Short reconnect backoff: a restarted trainer is picked up within a second.
        self._channel = channel(target, max_message_mb, extra_options=FAST_RECONNECT)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    # -- unary calls
    def start(self, stage: str, config: dict | str | None = None, job_id: str = "",
              timeout: float | None = None) -> trainer_pb2.Job:
        """Submit a job; resubmitting the same job_id with the same config returns the existing job."""
        config_json = config if isinstance(config, str) else json.dumps(config or {})
        return self._stub.StartJob(trainer_pb2.StartJobRequest(stage=stage, config_json=config_json, job_id=job_id),
                                   timeout=timeout or self.timeout, wait_for_ready=self.wait_for_ready)

    def cancel(self, job_id: str, timeout: float | None = None) -> trainer_pb2.Job:
        return self._stub.CancelJob(trainer_pb2.CancelJobRequest(job_id=job_id), timeout=timeout or self.timeout,
                                    wait_for_ready=self.wait_for_ready)

    def get(self, job_id: str, timeout: float | None = None, wait_for_ready: bool | None = None) -> trainer_pb2.Job:
        ready = self.wait_for_ready if wait_for_ready is None else wait_for_ready
        return self._stub.GetJob(trainer_pb2.GetJobRequest(job_id=job_id), timeout=timeout or self.timeout,
                                 wait_for_ready=ready)

    def list(self, stage: str = "", timeout: float | None = None) -> list[trainer_pb2.Job]:
        return list(self._stub.ListJobs(trainer_pb2.ListJobsRequest(stage=stage), timeout=timeout or self.timeout,
                                        wait_for_ready=self.wait_for_ready).jobs)

    # -- streaming
    def watch(self, job_id: str, after_seq: int = 0, timeout: float | None = None,
              retry_unavailable: bool = True,
              gone: Callable[[], str | None] | None = None) -> Iterator[trainer_pb2.JobEvent]:
        """Events with seq > after_seq until the job is terminal.

        If the trainer goes away (UNAVAILABLE), the watch is re-opened from the last seq
        seen, so no event is lost or repeated, until ``timeout`` seconds have passed in
        all (None = no limit; then DEADLINE_EXCEEDED / TimeoutError ends it).

        gone(): for a caller that runs the trainer process itself (`prorag run`), asked each time the trainer
        cannot be reached: a message (the process exited, and how) ends the watch with Unavailable, where
        waiting would wait for ever on a trainer that nothing starts again. Without it the watch waits for a
        trainer that its supervisor restarts (compose, Kubernetes).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seq = after_seq
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"watching job {job_id}: no terminal state within {timeout}s")
            # with gone(), an unreachable trainer fails the call at once so that gone() is asked between retries
            stream = self._stub.WatchJob(trainer_pb2.WatchJobRequest(job_id=job_id, after_seq=seq), timeout=left,
                                         wait_for_ready=retry_unavailable and gone is None)
            try:
                for ev in stream:
                    seq = ev.seq
                    yield ev
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                    raise TimeoutError(f"watching job {job_id}: no terminal state within {timeout}s") from exc
                if not retry_unavailable or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                why = gone() if gone is not None else None
                if why:
                    raise Unavailable(f"watching job {job_id}: the trainer at {self.target} is gone: {why}. "
                                      "Finished jobs are kept and an unfinished one resumes from its last "
                                      "checkpoint: run the same command again") from exc
                time.sleep(self.reconnect_backoff_s)
            finally:
                stream.cancel()

    def wait(self, job_id: str, timeout: float | None = None) -> trainer_pb2.Job:
        """Block until the job is SUCCEEDED, FAILED or CANCELLED and return it; TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"job {job_id}: no terminal state within {timeout}s")
            return remaining

        seq = 0
        while True:
            for ev in self.watch(job_id, after_seq=seq, timeout=left()):
                seq = ev.seq
            try:  # the stream ended at a terminal state; fetch the final record
                job = self.get(job_id, timeout=min(left() or self.timeout, self.timeout), wait_for_ready=True)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(self.reconnect_backoff_s)
                continue
            if job.state in TERMINAL_STATES:
                return job

    # -- helpers
    @staticmethod
    def config_of(job: trainer_pb2.Job) -> dict[str, Any]:
        return json.loads(job.config_json or "{}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TrainerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
