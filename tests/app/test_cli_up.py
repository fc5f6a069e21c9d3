"""`prorag up` as users run it: five services on the documented ports (+ offset), each found by a
reflection client, Search-R1 HTTP on the retriever, and SIGTERM stopping everything cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prorag import paths
from prorag.clients import wait_for_health
from tests.app.test_end_to_end import _free_offset

REPO = Path(__file__).resolve().parents[2]


def test_up_serves_all_five_and_stops_on_sigterm(tmp_path):
    off = _free_offset()
    env = dict(os.environ, PRORAG_HOME=str(tmp_path), PRORAG_TRACKING="local", PYTHONUNBUFFERED="1")
    env.pop("PRORAG_DATA", None)
    env.pop("PRORAG_RUNS", None)
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", "up", "--world", "tiny", "--port-offset", str(off)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        names = {"retriever": "Retriever", "policy": "Policy", "prm": "ProcessRewardModel", "judge": "Judge",
                 "trainer": "Trainer"}
        for svc, port in paths.GRPC_PORTS.items():
            target = f"127.0.0.1:{port + off}"
            assert wait_for_health(target, "", timeout=240), (tmp_path / "up.log").read_text()[-3000:]
            with grpc.insecure_channel(target) as ch:
                services = ProtoReflectionDescriptorDatabase(ch).get_services()
                assert f"prorag.v1.{names[svc]}" in services and "grpc.health.v1.Health" in services
        for svc in ("retriever", "policy", "trainer"):
            assert wait_for_health(f"127.0.0.1:{paths.GRPC_PORTS[svc] + off}", f"prorag.v1.{names[svc]}", timeout=60)
        req = urllib.request.Request(f"http://127.0.0.1:{paths.HTTP_PORTS['retriever'] + off}/retrieve",
                                     data=json.dumps({"queries": ["capital city"], "topk": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["result"][0]) == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{paths.HTTP_PORTS['policy'] + off}/v1/models", timeout=60) as r:
            assert json.loads(r.read())["data"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    time.sleep(0.5)
    for port in paths.GRPC_PORTS.values():  # every child is gone: nothing answers any more
        assert not wait_for_health(f"127.0.0.1:{port + off}", "", timeout=1)
