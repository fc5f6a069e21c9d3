"""Services forked (prorag_app/procs.py) from a process that holds gRPC servers and channels (the pipeline, `prorag
up`): gRPC's fork support, which prorag_app turns off, must not abort them between fork and exec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter imports the app first, as every `prorag` process does, starts a grpc.aio server and calls it
# through channels (so gRPC's event engine has its epoll poller running), then forks children whose time between
# fork and exec is stretched: descriptors closed as close_fds does, then a second in which a poller that a gRPC
# fork handler restarted in the child fails on its closed epoll descriptor and aborts the child. That is what
# happened to policy services the pipeline started during deep evaluations (grpc/grpc#43055). With gRPC's fork
# support on, 0-3 of the 6 children aborted per run here (so this part catches the fault most times; the setting's
# check catches it every time); with it off, none of them.
SCRIPT = textwrap.dedent("""
    import prorag_app
    import asyncio, json, os, subprocess, sys, threading, time
    import grpc
    from grpc._cython import cygrpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ready = threading.Event()
    ports = []

    async def serve():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        ready.set()
        await asyncio.sleep(3600)

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    assert ready.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}")
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    def slow_exec():
        os.closerange(3, 4096)
        time.sleep(1.0)

    codes = []
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=slow_exec, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=60)
        codes.append([p.returncode, err.decode()[-300:]])
    print(json.dumps({"env": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
                      "fork_support": bool(cygrpc.is_fork_support_enabled()), "children": codes}))
""")


def test_children_forked_beside_a_live_grpc_event_engine_reach_exec():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["env"] == "false" and got["fork_support"] is False
    assert [c for c, _ in got["children"]] == [0] * 6, got["children"]


def test_a_fork_support_setting_given_by_the_user_is_kept():
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}
    out = subprocess.run([sys.executable, "-c", "import os, prorag_app; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "true"
