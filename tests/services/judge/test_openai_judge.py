"""The judge service's `openai` backend against a real OpenAI-compatible server on loopback: the policy service's
own /v1/chat/completions (aiohttp, reached through the openai client). The policy server runs a scripted engine
that writes the reply a judging model would (a tiny random model cannot judge); everything between the judge and
that engine is real: HTTP, the openai client's retries, the prompt, parsing, the persistent cache, the budget,
gRPC status codes, and a judge restarted on the same cache file making no paid call."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from prorag.engine import GeneratedSeq, GenerationEngine
from prorag.pb import judge_pb2, judge_pb2_grpc
from prorag.rpc.pbconv import step_pb
from prorag.rpc.service import ServeConfig
from prorag.trajectory import Step
from services.judge.server import JudgeConfig, start as start_judge
from tests.helpers import LoopThread

Q = "Who founded the employer of Ana Lind?"
GOOD = Step("subquery", thought="First her employer.", content="Who employs Ana Lind?")
BAD = Step("subquery", thought="Guess.", content="Who founded Ana Lind?")


class ReplyEngine(GenerationEngine):
    """Writes ``reply`` (set by the test) for every prompt, and counts the prompts it saw."""

    name = "reply"

    def __init__(self, tok, max_model_len=4096):
        self.tokenizer, self.max_model_len = tok, max_model_len
        self.reply, self.calls = '{"chosen": 1, "reason": "step 1 names the right entity"}', 0

    def generate(self, prompts, params, adapter=None, seeds=None):
        self.calls += len(prompts)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        return [[GeneratedSeq(list(ids), [-0.1] * len(ids), "length", None)] * params.n for _ in prompts]

    def load_adapter(self, key, path): ...
    def unload_adapter(self, key): ...
    def adapters(self): return []
    def info(self): return {"engine": self.name}


@pytest.fixture(scope="module")
def endpoint(tiny_policy):
    from services.policy.server import PolicyConfig, start as start_policy

    model_dir, tok = tiny_policy
    engine = ReplyEngine(tok)
    loop = LoopThread()
    pol = loop.run(start_policy(ServeConfig(port=0, http_port=0), PolicyConfig(model=str(model_dir), world="tiny"),
                                engine=engine))
    yield f"http://127.0.0.1:{pol.http_port}/v1", engine, loop
    loop.run(pol.stop())
    loop.close()


def judge_server(loop, base_url, cache, **kw):
    cfg = JudgeConfig(backend="openai", base_url=base_url, model="judge-model", cache_path=str(cache),
                      max_retries=0, malformed_retries=1, timeout_s=10, **kw)
    started = loop.run(start_judge(ServeConfig(port=0), cfg))
    ch = grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}")
    return started, ch, judge_pb2_grpc.JudgeStub(ch)


def item(a=GOOD, b=BAD, id="p1", extra=()):
    return judge_pb2.JudgeItem(id=id, question=Q, golden_answers=["Oda Berg"],
                               candidates=[judge_pb2.Candidate(step=step_pb(s)) for s in (a, b, *extra)])


def test_pairs_are_judged_cached_and_never_paid_for_twice(endpoint, tmp_path):
    url, engine, loop = endpoint
    engine.reply = '{"chosen": 1, "reason": "step 1 names the right entity"}'
    started, ch, stub = judge_server(loop, url, tmp_path / "cache.jsonl")
    try:
        before = engine.calls
        v = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30).verdicts[0]
        assert (v.chosen, v.rejected, v.cached, v.backend) == (0, 1, False, "openai")
        assert "right entity" in v.rationale and engine.calls == before + 1
        again = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(id="p2")]), timeout=30).verdicts[0]
        assert (again.id, again.chosen, again.cached) == ("p2", 0, True) and engine.calls == before + 1
        engine.reply = 'Sure! {"chosen": 2, "reason": "the second"}'  # prose around the JSON is fine
        swapped = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(BAD, GOOD)]), timeout=30).verdicts[0]
        assert (swapped.chosen, swapped.rejected) == (1, 0)
        engine.reply = '{"chosen": null, "reason": "no clear winner"}'
        declined = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(GOOD, GOOD)]), timeout=30).verdicts[0]
        assert (declined.chosen, declined.rejected) == (-1, -1)
        info = stub.GetJudgeInfo(judge_pb2.JudgeInfoRequest(), timeout=5)
        assert (info.backend, info.model, info.cache_entries, info.calls_made) == ("openai", "judge-model", 3, 3)
        assert info.budget_left_usd == -1.0  # no dollar limit set
    finally:
        ch.close()
        loop.run(started.stop())
    rows = [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["key"]) == 64 and r["usage"]["prompt_tokens"] > 0 for r in rows)
    # a restarted judge on the same cache answers every judged pair without a call
    started, ch, stub = judge_server(loop, url, tmp_path / "cache.jsonl")
    try:
        calls = engine.calls
        vs = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(), item(BAD, GOOD), item(GOOD, GOOD)]),
                             timeout=30).verdicts
        assert [(v.chosen, v.cached) for v in vs] == [(0, True), (1, True), (-1, True)] and engine.calls == calls
    finally:
        ch.close()
        loop.run(started.stop())


def test_budget_bad_replies_and_bad_input_get_clear_statuses_and_the_judge_keeps_serving(endpoint, tmp_path):
    url, engine, loop = endpoint
    started, ch, stub = judge_server(loop, url, tmp_path / "c.jsonl", max_calls=3)
    try:
        engine.reply = "I think the first one is better."  # no JSON: asked again once, then UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no usable choice" in e.value.details()
        engine.reply = '{"chosen": 1, "reason": "ok"}'
        assert stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30).verdicts[0].chosen == 0
        # three paid calls made (two malformed, one good): a new pair is refused, the cached one still served
        with pytest.raises(grpc.RpcError) as e:
            stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(BAD, GOOD)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 of 3 paid calls" in e.value.details()
        assert stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30).verdicts[0].cached
        with pytest.raises(grpc.RpcError) as e:
            stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item(extra=(GOOD,))]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly two" in e.value.details()
    finally:
        ch.close()
        loop.run(started.stop())


def test_a_reply_whose_json_holds_a_lone_surrogate_is_malformed_and_never_cached(endpoint, tmp_path):
    """A judging model that writes a "\\ud800" escape (issue 51): no label, no cache row that could not be written
    as UTF-8, no RPC reply that could not be encoded; UNAVAILABLE after the retry, and the judge keeps serving."""
    url, engine, loop = endpoint
    started, ch, stub = judge_server(loop, url, tmp_path / "c.jsonl")
    try:
        engine.reply = '{"chosen": 1, "reason": "step 1 \\ud800"}'
        with pytest.raises(grpc.RpcError) as e:
            stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "no usable choice" in e.value.details() and "reason holds a lone high surrogate" in e.value.details()
        assert not (tmp_path / "c.jsonl").exists()
        engine.reply = '{"chosen": 2, "reason": "fine \\ud83d\\ude00"}'  # an escaped pair is one character
        v = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30).verdicts[0]
        assert v.chosen == 1 and v.rationale.endswith("\U0001f600")
        assert "\U0001f600" in (tmp_path / "c.jsonl").read_text(encoding="utf-8")
    finally:
        ch.close()
        loop.run(started.stop())


def test_unreachable_endpoint_is_unavailable(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = LoopThread()
    started, ch, stub = judge_server(loop, f"http://127.0.0.1:{port}/v1", tmp_path / "c.jsonl")
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in e.value.details()
    finally:
        ch.close()
        loop.run(started.stop())
        loop.close()


def test_a_secured_endpoint_is_reached_with_the_key_from_a_file_and_a_wrong_key_is_a_precondition(
        tiny_policy, tmp_path):
    """The policy's HTTP side with bearer tokens on: the judge's API key (read from a mounted file) is the token."""
    from prorag.rpc.security import generate_secrets
    from services.policy.server import PolicyConfig, start as start_policy

    files = generate_secrets(tmp_path / "secrets")
    model_dir, tok = tiny_policy
    loop = LoopThread()
    pol = loop.run(start_policy(ServeConfig(port=0, http_port=0, auth_tokens=files["tokens"]),
                                PolicyConfig(model=str(model_dir), world="tiny",
                                             adapter_root=str(tmp_path / "adapters")), engine=ReplyEngine(tok)))
    url = f"http://127.0.0.1:{pol.http_port}/v1"
    (tmp_path / "wrong").write_text("w" * 43)
    try:
        started, ch, stub = judge_server(loop, url, tmp_path / "c1.jsonl", api_key_file=files["token_client"])
        try:
            v = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30).verdicts[0]
            assert (v.chosen, v.rejected) == (0, 1)
        finally:
            ch.close()
            loop.run(started.stop())
        started, ch, stub = judge_server(loop, url, tmp_path / "c2.jsonl", api_key_file=str(tmp_path / "wrong"))
        try:
            with pytest.raises(grpc.RpcError) as e:
                stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[item()]), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            ch.close()
            loop.run(started.stop())
    finally:
        loop.run(pol.stop())
        loop.close()
