"""What operators get from a running service (issue 31 item 2): Prometheus metrics scraped over HTTP from a
`prorag serve` process, its JSON log lines, and a request id that follows a policy rollout into the retriever."""

from __future__ import annotations

import json
import logging
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
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import LoopThread, env, scripted_engine_base

ROOT = Path(__file__).resolve().parents[2]
RETRIEVER = "prorag.v1.Retriever"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny world with its BM25 index (the dense one is not needed here, and is the slow one to build)."""
    data = tmp_path_factory.mktemp("obs") / "data"
    with env("PRORAG_DATA", str(data)):
        from prorag_app.embedded import ensure_indexes

        ensure_indexes("tiny", dense=False)
        yield data


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_served_retriever_exports_metrics_and_json_logs(data, tmp_path):
    err_path = tmp_path / "stderr.log"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prorag_app.cli", "serve", "retriever", "--port", "0", "--http-port", "0",
             "--metrics-port", "0", "--set", "world=tiny", "--set", "default_index=bm25"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PRORAG_DATA": str(data)})
    try:
        line = proc.stdout.readline()  # printed once every port is bound
        m = re.search(r"gRPC on 127\.0\.0\.1:(\d+), HTTP on 127\.0\.0\.1:(\d+), metrics on (http://\S+/metrics)", line)
        assert m, f"unexpected start line {line!r}; stderr: {err_path.read_text()[-2000:]}"
        grpc_port, http_port, metrics_url = int(m[1]), int(m[2]), m[3]

        from prorag.pb import retriever_pb2, retriever_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            stub = retriever_pb2_grpc.RetrieverStub(ch)
            for i, queries in enumerate((["Who founded Kest?"], ["river", "mountain", "album"], ["city"])):
                stub.Search(retriever_pb2.SearchRequest(queries=queries, topk=2), timeout=30,
                            metadata=[("x-request-id", f"scrape-test-{i}")])
            with pytest.raises(grpc.RpcError) as ei:
                stub.Search(retriever_pb2.SearchRequest(queries=[], topk=2), timeout=30,
                            metadata=[("x-request-id", "scrape-test-bad")])
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/retrieve", headers={"X-Request-Id": "http-1"},
                                     data=json.dumps({"queries": ["Who founded Kest?"], "topk": 1}).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "http-1"
        with pytest.raises(urllib.error.HTTPError) as hi:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http_port}/retrieve",
                                                          data=b'{"queries": []}'), timeout=30)
        assert hi.value.code == 400

        s = scrape(metrics_url)
        search = dict(grpc_service=RETRIEVER, grpc_method="Search", grpc_type="unary")
        assert value(s, "grpc_server_handled_total", grpc_code="OK", **search) == 3
        assert value(s, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **search) == 1
        assert value(s, "grpc_server_started_total", **search) == 4
        assert value(s, "grpc_server_handling_seconds_count", **search) == 4
        assert value(s, "grpc_server_handling_seconds_bucket", le="+Inf", **search) == 4
        assert value(s, "grpc_server_handling_seconds_sum", **search) > 0
        assert value(s, "prorag_http_requests_total", route="/retrieve", method="POST", code="200") == 1
        assert value(s, "prorag_http_requests_total", route="/retrieve", method="POST", code="400") == 1
        # 5 valid queries over gRPC and 1 over HTTP reached the batcher; the refused calls never did
        assert value(s, "prorag_batcher_batch_items_sum", batcher="retriever") == 6
        calls = value(s, "prorag_batcher_batch_items_count", batcher="retriever")
        assert 1 <= calls <= 4 and value(s, "prorag_batcher_batch_requests_sum", batcher="retriever") == 4
        assert ("prorag_batcher_queue_depth", (("batcher", "retriever"),)) in s
        assert value(s, "prorag_batcher_queue_depth", batcher="retriever") == 0
        assert value(s, "process_resident_memory_bytes") > 0  # the process collectors come along
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    # logs: one JSON object per line, every key present; the calls' lines carry the callers' ids
    records = [json.loads(line) for line in err_path.read_text().splitlines() if line.startswith("{")]
    keys = {"time", "level", "service", "rpc", "status", "latency_ms", "request_id", "message"}
    assert records and all(keys <= r.keys() for r in records)
    calls = {r["request_id"]: r for r in records if r["rpc"]}
    ok = calls["scrape-test-1"]
    assert (ok["service"], ok["rpc"], ok["status"], ok["level"]) == ("retriever", f"{RETRIEVER}/Search", "OK", "INFO")
    assert ok["latency_ms"] > 0
    bad = calls["scrape-test-bad"]
    assert bad["status"] == "INVALID_ARGUMENT" and "no queries" in bad["message"]
    assert calls["http-1"]["rpc"] == "POST /retrieve" and calls["http-1"]["status"] == "200"
    # a caller without an id gets one made for it
    (anon,) = [r for r in records if r["rpc"] == "POST /retrieve" and r["status"] == "400"]
    assert re.fullmatch(r"[0-9a-f]{32}", anon["request_id"])


# ---------------------------------------------------------------- a rollout's id, policy -> retriever
class SearchThenAnswer(scripted_engine_base()):
    """Searches once, then answers: every rollout calls the retriever exactly once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len = tokenizer, 4096

    def generate(self, prompts, params, adapter=None, seeds=None):
        from prorag.engine import GeneratedSeq
        from prorag.rollout import decode

        out = []
        for p in prompts:
            step = ("It says so.</step>\n<answer>\nTova Lunn</answer>" if "</retrieval>" in decode(self.tokenizer, p)
                    else "I search first.</step>\n<subquery>\nWho founded Mai Brewery?</subquery>")
            ids = self.tokenizer.encode(step, add_special_tokens=False)
            out.append([GeneratedSeq(ids, [-0.5] * len(ids), "stop", ids[-1]) for _ in range(params.n)])
        return out


class Lines(logging.Handler):
    """The JSON lines the services would write, kept in memory."""

    def __init__(self):
        from prorag.rpc.observability import JsonFormatter

        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_a_rollouts_request_id_reaches_the_retrievers_log(data, tiny_policy):
    from prometheus_client import REGISTRY

    from prorag.rpc.clients import PolicyClient
    from prorag.rpc.observability import reset_request_id, set_request_id
    from prorag.rpc.service import ServeConfig
    from services.policy.server import PolicyConfig, start as start_policy
    from services.retriever.server import RetrieverConfig, start as start_retriever

    model_dir, tok = tiny_policy
    handler, rpc_log = Lines(), logging.getLogger("prorag.rpc")
    rpc_log.addHandler(handler)
    old_level = rpc_log.level
    rpc_log.setLevel(logging.INFO)
    tokens_before = REGISTRY.get_sample_value("prorag_policy_generated_tokens_total") or 0.0
    policy_calls_before = REGISTRY.get_sample_value("prorag_batcher_batch_items_count", {"batcher": "policy"}) or 0.0
    loop = LoopThread()
    servers = []
    try:
        with env("PRORAG_DATA", str(data)):
            r = loop.run(start_retriever(ServeConfig(port=0, http_port=-1),
                                         RetrieverConfig(world="tiny", default_index="bm25")))
            servers.append(r)
            p = loop.run(start_policy(ServeConfig(port=0, http_port=-1),
                                      PolicyConfig(model=str(model_dir), world="tiny", restore_active=False,
                                                   retriever=f"127.0.0.1:{r.grpc_port}"),
                                      engine=SearchThenAnswer(tok)))
            servers.append(p)
        # the typed client sends the id of the request its caller is serving: here, one set by hand
        token = set_request_id("rollout-1234")
        try:
            with PolicyClient(f"127.0.0.1:{p.grpc_port}", timeout=60) as c:
                events = list(c.rollout([("q1", "Who founded Mai Brewery?")], c.sampling(n=2), max_steps=4, topk=1))
        finally:
            reset_request_id(token)
        assert events[-1].num_trajectories == 2 and events[-1].searches_made == 1
    finally:
        for s in reversed(servers):
            loop.run(s.stop())
        loop.close()
        rpc_log.removeHandler(handler)
        rpc_log.setLevel(old_level)

    records = [json.loads(line) for line in handler.lines]
    mine = [(r["service"], r["rpc"], r["status"]) for r in records if r["request_id"] == "rollout-1234"]
    assert ("policy", "prorag.v1.Policy/Rollout", "OK") in mine
    assert ("retriever", f"{RETRIEVER}/Search", "OK") in mine, records
    # the policy's metrics: tokens generated (2 samples x 2 steps) and its batcher's calls
    step_tokens = sum(len(tok.encode(t, add_special_tokens=False)) for t in (
        "I search first.</step>\n<subquery>\nWho founded Mai Brewery?</subquery>",
        "It says so.</step>\n<answer>\nTova Lunn</answer>"))
    assert REGISTRY.get_sample_value("prorag_policy_generated_tokens_total") - tokens_before == 2 * step_tokens
    assert REGISTRY.get_sample_value("prorag_batcher_batch_items_count", {"batcher": "policy"}) > policy_calls_before
    # no adapter active: the base model alone
    from prorag.registry import weights_sha256

    assert REGISTRY.get_sample_value("prorag_policy_adapter_info",
                                     {"active": "", "base_model_sha256": weights_sha256(model_dir)[:16]}) == 1


def test_prm_and_trainer_metrics(tiny_policy, tmp_path):
    from prometheus_client import REGISTRY

    from prorag.rpc.clients import PRMClient
    from prorag.rpc.clients_trainer import TrainerClient, state_name
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from prorag.rpc.service import ServeConfig
    from prorag.trajectory import Step
    from services.prm.engine import PRMEngine
    from services.prm.server import PRMServeConfig, start as start_prm
    from services.trainer.server import TrainerConfig, start as start_trainer

    prm, prm_tok = prm_from_policy(str(tiny_policy[0]), seed=1)
    save_pretrained(prm, prm_tok, tmp_path / "prm")
    engine = PRMEngine(tmp_path / "prm")
    scored_before = REGISTRY.get_sample_value("prorag_prm_steps_scored_total") or 0.0
    loop = LoopThread()
    servers = []
    try:
        s = loop.run(start_prm(ServeConfig(port=0), PRMServeConfig(), engine=engine))
        servers.append(s)
        assert REGISTRY.get_sample_value("prorag_prm_model_info", {"version": engine.version}) == 1
        steps = [Step("subquery", "I search first.", "Who founded Mai Brewery?"),
                 Step("answer", "It says.", "Tova Lunn")]
        with PRMClient(f"127.0.0.1:{s.grpc_port}", timeout=60) as c:
            version, scores = c.score([("Who founded Mai Brewery?", steps, False), ("Who?", steps[:1], False)])
        assert version == engine.version and [len(x) for x in scores] == [2, 1]
        assert REGISTRY.get_sample_value("prorag_prm_steps_scored_total") - scored_before == 3

        t = loop.run(start_trainer(ServeConfig(port=0, grace_s=1),
                                   TrainerConfig(jobs_root=str(tmp_path / "jobs"), tracking="local")))
        servers.append(t)
        states = {st: REGISTRY.get_sample_value("prorag_trainer_jobs", {"state": st})
                  for st in ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")}
        assert states == dict.fromkeys(states, 0.0)  # every state is there, none held yet
        with TrainerClient(f"127.0.0.1:{t.grpc_port}", timeout=10) as tc:
            tc.start("selftest", {"steps": 5, "checkpoint_every": 5, "log_every": 5, "tracking": "local"},
                     job_id="metrics-1")
            assert state_name(tc.wait("metrics-1", timeout=60).state) == "SUCCEEDED"
        assert REGISTRY.get_sample_value("prorag_trainer_jobs", {"state": "SUCCEEDED"}) == 1
        assert REGISTRY.get_sample_value("prorag_trainer_jobs", {"state": "RUNNING"}) == 0
    finally:
        for srv in reversed(servers):
            loop.run(srv.stop())
        loop.close()
    # a stopped trainer's jobs are no longer reported
    assert REGISTRY.get_sample_value("prorag_trainer_jobs", {"state": "SUCCEEDED"}) == 0
