"""prorag.rpc.clients.wait_for_health notices a service that comes up late promptly: its own poll loop is the
backoff, not gRPC's reconnect backoff, which after a dozen seconds of failures waits ~10 s between tries (that
made `prorag up` still be waiting for a slow policy while clients already used it)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prorag.rpc.clients import wait_for_health
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
