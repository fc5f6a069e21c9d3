"""Bounds on the work one caller can ask of the policy service, over real gRPC and HTTP on loopback: the total
tokens a request may generate, the rollout queue, the number of calls in flight, prompt sizes on HTTP, and a
rollout that stops once its caller has gone or its deadline passed (not only while it waits in a queue).

The engine is scripted (one step per round, 0.2 s per engine call) so that a rollout runs for many rounds."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from prorag.rpc.clients import PolicyClient
from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread
from tests.services.http_json import post_json
from tests.test_rollout import ScriptedEngine

LOOP_Q = "Loop question?"
SCRIPTS = {LOOP_Q: ["Hmm.</step>\n<subanswer>\nnothing</subanswer>"] * 40,
           "What is two plus two?": ["Easy.</step>\n<answer>\nfour</answer>"]}


class SlowEngine(ScriptedEngine):
    def __init__(self, tok, delay_s: float = 0.2):
        super().__init__(tok, SCRIPTS)
        self.delay_s = delay_s

    def generate(self, prompts, params, adapter=None, seeds=None):
        time.sleep(self.delay_s)
        return super().generate(prompts, params, adapter, seeds)


@pytest.fixture(scope="module")
def loop():
    lp = LoopThread()
    yield lp
    lp.close()


def _start(loop, tiny_policy, tmp_path_factory, serve: ServeConfig | None = None, **limits):
    from services.policy.server import PolicyConfig, start

    model_dir, tok = tiny_policy
    engine = SlowEngine(tok)
    cfg = PolicyConfig(model=str(model_dir), retriever="127.0.0.1:1", max_steps=40, default_max_steps=40,
                       max_tokens=64, default_step_tokens=64,
                       adapter_root=str(tmp_path_factory.mktemp("adapters")), **limits)
    started = loop.run(start(serve or ServeConfig(port=0, http_port=0), cfg, engine=engine))
    return started, engine


@pytest.fixture(scope="module")
def policy(loop, tiny_policy, tmp_path_factory):
    started, engine = _start(loop, tiny_policy, tmp_path_factory, max_concurrent_rollouts=1, max_queued_rollouts=1,
                             max_request_tokens=20_000, max_prefixes=8, max_prefix_tokens=256)
    yield started, engine
    loop.run(started.stop())


def _calls_settle(engine, wait_s: float = 1.0) -> int:
    """The engine's call count once it stopped growing for ``wait_s``."""
    before = -1
    while before != len(engine.calls):
        before = len(engine.calls)
        time.sleep(wait_s)
    return before


def test_a_rollout_stops_working_once_its_deadline_passed(policy):
    started, engine = policy
    _calls_settle(engine, 0.3)
    n0 = len(engine.calls)
    with PolicyClient(f"127.0.0.1:{started.grpc_port}") as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.rollout([("q", LOOP_Q)], c.sampling(max_tokens=64), max_steps=40, timeout=0.7))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # 40 rounds x 0.2 s would keep the engine busy for 8 s; it stops within a round or two of the deadline.
    assert _calls_settle(engine) - n0 <= 8


def test_a_cancelled_rollout_stops_working(policy):
    started, engine = policy
    _calls_settle(engine, 0.3)
    n0 = len(engine.calls)
    from prorag.pb import policy_pb2, policy_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}") as ch:
        call = policy_pb2_grpc.PolicyStub(ch).Rollout(policy_pb2.RolloutRequest(
            questions=[policy_pb2.RolloutQuestion(id="q", question=LOOP_Q)], max_steps=40,
                sampling=policy_pb2.SamplingParams(n=1, max_tokens=64)), timeout=60)
        threading.Timer(0.7, call.cancel).start()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert _calls_settle(engine) - n0 <= 8


def test_rollouts_beyond_the_queue_are_refused_then_served_again(policy):
    started, engine = policy
    target = f"127.0.0.1:{started.grpc_port}"
    errors = []

    def long_rollout():
        with PolicyClient(target) as c:
            try:
                list(c.rollout([("q", LOOP_Q)], c.sampling(max_tokens=64), max_steps=12))
            except grpc.RpcError as ex:  # pragma: no cover - reported below
                errors.append(ex)

    threads = [threading.Thread(target=long_rollout) for _ in range(2)]  # one running, one queued
    for t in threads:
        t.start()
    time.sleep(0.5)
    with PolicyClient(target) as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.rollout([("q2", "What is two plus two?")], max_steps=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.value.details()
        for t in threads:
            t.join(60)
        assert not errors
        events = list(c.rollout([("q2", "What is two plus two?")], max_steps=2))
        assert events[0].answer == "four"


def test_requests_asking_for_too_much_work_are_refused(policy):
    started, _ = policy
    with PolicyClient(f"127.0.0.1:{started.grpc_port}") as c:
        with pytest.raises(grpc.RpcError) as e:  # 8 x 8 x 40 x 64 = 163,840 > 20,000
            list(c.rollout([(str(i), "What is two plus two?") for i in range(8)], c.sampling(n=8, max_tokens=64),
                           max_steps=40))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "split" in e.value.details()
        assert "max_request_tokens" in e.value.details()
        events = list(c.rollout([("q2", "What is two plus two?")], c.sampling(n=2, max_tokens=64), max_steps=2))
        assert [e.answer for e in events[:-1]] == ["four", "four"]  # the server keeps serving


def _post(port: int, body) -> tuple[int, dict]:
    return post_json(f"http://127.0.0.1:{port}/v1/completions", body)


def test_http_completions_are_bounded(policy):
    started, _ = policy
    port = started.http_port
    status, body = _post(port, {"prompt": ["hi"] * 9, "max_tokens": 2})
    assert status == 400 and "at most 8" in body["error"]["message"]
    status, body = _post(port, {"prompt": "x" * (256 * 16 + 1), "max_tokens": 2})
    assert status == 400 and "characters" in body["error"]["message"]
    status, body = _post(port, {"prompt": ["hi"] * 8, "n": 64, "max_tokens": 64})
    assert status == 429 and "max_request_tokens" in body["error"]["message"]  # 32,768 > 20,000
    # within the bound (8 x 8 x 64 = 4,096 tokens), the request reaches the engine (which only knows rollout prompts)
    from prorag import trajectory as T

    status, body = _post(port, {"prompt": [T.render_prompt("What is two plus two?")] * 8, "n": 8, "max_tokens": 64})
    assert status == 200 and len(body["choices"]) == 8  # the scripted engine answers once per prompt, whatever n


def test_calls_beyond_max_concurrent_rpcs_are_refused(loop, tiny_policy, tmp_path_factory):
    started, engine = _start(loop, tiny_policy, tmp_path_factory, ServeConfig(port=0, max_concurrent_rpcs=1))
    target = f"127.0.0.1:{started.grpc_port}"
    try:
        def busy():
            with PolicyClient(target) as c:
                list(c.rollout([("q", LOOP_Q)], max_steps=8))

        t = threading.Thread(target=busy)
        t.start()
        time.sleep(0.5)
        with PolicyClient(target) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.model_info()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        t.join(60)
        with PolicyClient(target) as c:
            assert c.model_info().engine == "scripted"
    finally:
        loop.run(started.stop())
