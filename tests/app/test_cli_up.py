"""`prorag up` as users run it, secured: five services on the documented ports (+ offset) with TLS and bearer
tokens from the environment (as a Secret would give them), each found by a reflection client holding a token
and refusing one without, Search-R1 HTTP on the retriever (401 without a token), and SIGTERM stopping
everything cleanly. (The end-to-end test runs the same stack in plaintext.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prorag import paths
from prorag.clients import wait_for_health
from tests.app.test_end_to_end import _free_offset

REPO = Path(__file__).resolve().parents[2]


def test_up_serves_all_five_securely_and_stops_on_sigterm(tmp_path, monkeypatch):
    from prorag.clients import channel
    from prorag.security import ClientSecurity, generate_secrets

    off = _free_offset()
    files = generate_secrets(tmp_path / "secrets")
    # One environment for servers and clients alike; the stack's own clients (health, the trainer's calls to
    # the policy and retriever) use the admin token.
    security_env = {"PRORAG_TLS_CERT": files["server_cert"], "PRORAG_TLS_KEY": files["server_key"],
                    "PRORAG_AUTH_TOKENS": files["tokens"], "PRORAG_TLS_CA": files["ca"],
                    "PRORAG_TOKEN_FILE": files["token_admin"]}
    for k, v in security_env.items():
        monkeypatch.setenv(k, v)
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
            with channel(target) as ch:
                services = ProtoReflectionDescriptorDatabase(ch).get_services()
                assert f"prorag.v1.{names[svc]}" in services and "grpc.health.v1.Health" in services
            with channel(target, security=ClientSecurity(tls_ca=files["ca"])) as ch:  # no token
                try:
                    ProtoReflectionDescriptorDatabase(ch).get_services()
                    raise AssertionError(f"{svc} answered reflection without a token")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (svc, e)
        for svc in ("retriever", "policy", "trainer"):
            assert wait_for_health(f"127.0.0.1:{paths.GRPC_PORTS[svc] + off}", f"prorag.v1.{names[svc]}", timeout=60)
        ctx = ClientSecurity(tls_ca=files["ca"]).ssl_context()
        token = open(files["token_client"]).read().strip()
        url = f"https://127.0.0.1:{paths.HTTP_PORTS['retriever'] + off}/retrieve"
        body = json.dumps({"queries": ["capital city"], "topk": 2}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60, context=ctx)
            raise AssertionError("/retrieve answered without a token")
        except urllib.error.HTTPError as e:
            assert e.code == 401
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            assert len(json.loads(r.read())["result"][0]) == 2
        req = urllib.request.Request(f"https://127.0.0.1:{paths.HTTP_PORTS['policy'] + off}/v1/models",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            assert json.loads(r.read())["data"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    time.sleep(0.5)
    for port in paths.GRPC_PORTS.values():  # every child is gone: nothing answers any more
        assert not wait_for_health(f"127.0.0.1:{port + off}", "", timeout=1)
