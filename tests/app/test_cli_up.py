"""`prorag up` as users run it, secured: five services on the documented ports (+ offset) with TLS and bearer
tokens from the environment (as a Secret would give them), each found by a reflection client holding a token
and refusing one without, Search-R1 HTTP on the retriever (401 without a token), and SIGTERM stopping
everything cleanly; with no PRM published its PRM service starts empty and `up` says why. (The end-to-end test
runs the same stack in plaintext.) Then `prorag up` after a training run: it serves the newest PRM published for
the world, and the README's retriever and PRM client examples run against it as printed."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prorag import paths
from prorag.rpc.clients import wait_for_health
from tests.helpers import free_offset

REPO = Path(__file__).resolve().parents[2]


def test_up_serves_all_five_securely_and_stops_on_sigterm(tmp_path, monkeypatch):
    from prorag.rpc.clients import channel
    from prorag.rpc.security import ClientSecurity, generate_secrets

    off = free_offset()
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
    proc = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", "up", "--world", "tiny",
                             "--port-offset", str(off)],
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
        # nothing trained a PRM in this home: the PRM service is live but not ready, and `up` said why
        assert not wait_for_health(f"127.0.0.1:{paths.GRPC_PORTS['prm'] + off}", "prorag.v1.ProcessRewardModel",
                                   timeout=2)
        assert "prm starts empty: no PRM is published for world 'tiny'" in (tmp_path / "up.log").read_text()
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
        t_stop = time.monotonic()
        code = proc.wait(60)
        stop_s = time.monotonic() - t_stop
    assert code == 0, (code, f"{stop_s:.1f} s after SIGTERM", (tmp_path / "up.log").read_text()[-3000:])
    time.sleep(0.5)
    for port in paths.GRPC_PORTS.values():  # every child is gone: nothing answers any more
        assert not wait_for_health(f"127.0.0.1:{port + off}", "", timeout=1)


# ---------------------------------------------------------------- the PRM `prorag up` serves
SECURITY_VARS = ("PRORAG_TLS_CERT", "PRORAG_TLS_KEY", "PRORAG_TLS_CLIENT_CA", "PRORAG_AUTH_TOKENS", "PRORAG_TLS_CA",
                 "PRORAG_TLS_CLIENT_CERT", "PRORAG_TLS_CLIENT_KEY", "PRORAG_TLS_SERVER_NAME", "PRORAG_TOKEN_FILE",
                 "PRORAG_TOKEN")


def _publish_prm(policy_dir: Path, scratch: Path, world: str, key: str, created_at: str, seed: int) -> None:
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from prorag.registry import MANIFEST, ArtifactRef, registry

    prm, tok = prm_from_policy(policy_dir, seed=seed)
    src = save_pretrained(prm, tok, scratch / key.replace("@", "-"))
    ref = ArtifactRef.parse(key)
    prms = registry("prm", world)
    prms.publish(src, ref)
    # created_at has one-second resolution: set it rather than sleep between publishes (the hash covers weights only)
    manifest = prms.path(ref) / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "created_at": created_at}))


@pytest.fixture
def two_prms(tiny_policy, tmp_path, monkeypatch):
    """World tiny's PRM registry under tmp_path holding an older and a newer PRM under different names; the older
    one has the larger version string, so only the publication time can pick the newer."""
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    model_dir, _ = tiny_policy
    _publish_prm(model_dir, tmp_path / "scratch", "tiny", "prm@zz-old", "2026-01-01T00:00:00+00:00", seed=1)
    _publish_prm(model_dir, tmp_path / "scratch", "tiny", "prm-6ep@aa-new", "2026-02-01T00:00:00+00:00", seed=2)
    return "prm-6ep@aa-new", "prm@zz-old"


def test_up_picks_the_newest_prm_or_the_one_named_or_none(two_prms, tmp_path):
    from prorag.errors import NotFound
    from prorag_app.cli import served_prm

    newest, older = two_prms
    model, why = served_prm("tiny", None)
    assert model == newest and f"prm serves {newest}, the newest of 2" in why and "--prm" in why
    assert served_prm("tiny", older)[0] == older
    assert served_prm("tiny", "prm")[0] == "prm"  # a bare name: the service resolves its newest version
    model, why = served_prm("tiny", "none")
    assert model is None and "starts empty" in why and "FAILED_PRECONDITION" in why
    with pytest.raises(NotFound) as ei:
        served_prm("tiny", "prm@nope")
    # the refusal names what is published and how to start without one
    assert older in str(ei.value) and newest in str(ei.value) and "--prm none" in str(ei.value)
    rel = Path(os.path.relpath(tmp_path / "data" / "prms" / "tiny" / "prm" / "zz-old"))
    assert served_prm("tiny", str(rel))[0] == str(rel.resolve())  # the services may run elsewhere than the cwd
    model, why = served_prm("other-world", None)
    assert model is None and "no PRM is published for world 'other-world'" in why


def _readme_block(lang: str, marker: str) -> str:
    """The one fenced ```lang block of README.md that contains ``marker``, as a reader would copy it."""
    readme = (REPO / "README.md").read_text()
    blocks = [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", readme, re.S | re.M)
              if tag == lang and marker in body]
    assert len(blocks) == 1, f"README.md should hold exactly one ```{lang} block with {marker!r}, found {len(blocks)}"
    return blocks[0]


def test_up_serves_the_newest_prm_and_the_readme_examples_run_as_printed(two_prms, tmp_path, monkeypatch):
    newest, _ = two_prms
    for var in SECURITY_VARS:  # the README's examples call a plaintext `prorag up`
        monkeypatch.delenv(var, raising=False)
    off = free_offset()
    env = dict(os.environ, PRORAG_TRACKING="local", PYTHONUNBUFFERED="1")
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", "up", "--world", "tiny",
                             "--port-offset", str(off)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        prm_target = f"127.0.0.1:{paths.GRPC_PORTS['prm'] + off}"
        # ready, not just live: the PRM service becomes ready only with a PRM loaded
        assert wait_for_health(prm_target, "prorag.v1.ProcessRewardModel", timeout=240), \
            (tmp_path / "up.log").read_text()[-3000:]
        assert wait_for_health(f"127.0.0.1:{paths.GRPC_PORTS['retriever'] + off}", "prorag.v1.Retriever", timeout=120)
        assert f"prm serves {newest}, the newest of 2 PRM(s) published for world 'tiny'" in \
            (tmp_path / "up.log").read_text()

        code = _readme_block("python", "ProcessRewardModelStub")
        assert code.count('"127.0.0.1:50053"') == 1  # the only change: the test's port offset
        code = code.replace("127.0.0.1:50053", prm_target)
        # run as another system would: a separate interpreter, outside the repository
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        version, scores = out.stdout.strip().split(" ", 1)
        scores = ast.literal_eval(scores)
        assert version == newest
        assert len(scores) == 2 and all(isinstance(x, float) and math.isfinite(x) for x in scores), scores

        curl = _readme_block("bash", "/retrieve").strip()
        assert curl.count("localhost:8000") == 1
        curl = curl.replace("localhost:8000", f"127.0.0.1:{paths.HTTP_PORTS['retriever'] + off}")
        out = subprocess.run(["bash", "-c", curl], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        (docs,) = json.loads(out.stdout)["result"]  # one list per query
        assert len(docs) == 3 and all(d["document"]["id"] and d["document"]["contents"] and
                                      isinstance(d["score"], float) for d in docs), docs
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
