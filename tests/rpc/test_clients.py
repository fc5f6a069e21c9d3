"""prorag.rpc.clients.wait_for_health notices a service that comes up late promptly: its own poll loop is the
backoff, not gRPC's reconnect backoff, which after a dozen seconds of failures waits ~10 s between tries (that
made `prorag up` still be waiting for a slow policy while clients already used it)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import pytest

from prorag.errors import DeadlineExceeded
from prorag.rpc.clients import DEADLINE_RETRIES, call_with_service_wait, wait_for_health
from tests.helpers import free_port


def test_wait_for_health_sees_a_late_service_within_its_own_poll_interval():
    port = free_port()
    late_s = 20.0  # gRPC's default backoff tries at ~0, 1, 2.6, 5.2, 9.3, 15.8, 26.3 s (each +-20%)
    servers, started_at = [], []

    def start_late():
        time.sleep(late_s)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        started_at.append(time.monotonic())
        servers.append(server)

    starter = threading.Thread(target=start_late, daemon=True)
    starter.start()
    try:
        assert wait_for_health(f"127.0.0.1:{port}", "", timeout=late_s + 30.0)
        # noticed within a few of its own 0.2 s polls (1 s reconnect backoff at most), not gRPC's ~10 s
        assert time.monotonic() - started_at[0] < 3.0
    finally:
        starter.join()
        for server in servers:
            server.stop(None)


def test_wait_for_health_is_false_when_nothing_listens():
    assert not wait_for_health(f"127.0.0.1:{free_port()}", "", timeout=1.0)


def _slow_service(slow_calls: int):
    """A real server on port 0 (with a health service) whose first ``slow_calls`` calls outlast a 0.3 s deadline;
    the later ones answer at once. Returns (server, target, calls: the requests it saw)."""
    calls: list[bytes] = []

    def handle(request: bytes, context) -> bytes:
        calls.append(request)
        if len(calls) <= slow_calls:
            time.sleep(1.5)
        return b"answer to " + request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Slow", {"Call": grpc.unary_unary_rpc_method_handler(handle)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", calls


def _call(target: str):
    channel = grpc.insecure_channel(target)
    call = channel.unary_unary("/t.Slow/Call")
    return lambda: call(b"q1", timeout=0.3)


def test_a_call_whose_deadline_ran_out_is_made_once_more_with_the_same_request():
    server, target, calls = _slow_service(slow_calls=DEADLINE_RETRIES)
    try:
        stats: dict = {}
        got = call_with_service_wait(_call(target), target, "policy", wait_s=5.0, stats=stats)
        assert got == b"answer to q1"
        assert calls == [b"q1"] * (DEADLINE_RETRIES + 1)
        assert stats["service_retries"] == DEADLINE_RETRIES
    finally:
        server.stop(None)


def test_a_service_that_keeps_missing_the_deadline_fails_the_call_naming_it():
    server, target, calls = _slow_service(slow_calls=100)
    try:
        with pytest.raises(DeadlineExceeded) as err:
            call_with_service_wait(_call(target), target, "policy", wait_s=5.0)
        assert f"the policy service at {target} did not answer within the call's deadline" in str(err.value)
        assert "resumed" in str(err.value)
        assert len(calls) == DEADLINE_RETRIES + 1
    finally:
        server.stop(None)
