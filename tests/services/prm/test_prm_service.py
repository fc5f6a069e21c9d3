"""The PRM service as a real gRPC server on port 0 on loopback: whole trajectories scored in one pass, equal to
the engine in process; concurrent callers merged, each scored as alone; a full queue refused with
RESOURCE_EXHAUSTED and a passed deadline with DEADLINE_EXCEEDED; the version in every response; hot-swap of a newly
published PRM; bad input refused with the right status while the server keeps serving."""

import threading
import time

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from prorag.data.loaders import Document
from prorag.modeling import save_pretrained
from prorag.pb import common_pb2, prm_pb2, prm_pb2_grpc
from prorag.rpc.pbconv import step_pb
from prorag.prm.model import prm_from_policy
from prorag.registry import ArtifactRef, registry
from prorag.rpc.service import ServeConfig
from prorag.trajectory import Step
from services.prm.engine import PRMEngine, ScoringItem
from services.prm.server import PRMServeConfig, start
from tests.helpers import LoopThread

DOC = Document(id="d1", title="Mai Brewery", text="Mai Brewery was founded by Tova Lunn.",
               contents='"Mai Brewery"\nMai Brewery was founded by Tova Lunn.')
STEPS = [Step("subquery", thought="First the founder.", content="Who founded Mai Brewery?", docs=[DOC]),
         Step("subanswer", thought="The document says.", content="Tova Lunn"),
         Step("answer", thought="Done.", content="Tova Lunn")]
Q = "Who founded Mai Brewery?"


class CountingEngine(PRMEngine):
    calls = 0

    def score(self, items):
        type(self).calls += 1
        time.sleep(0.05)  # long enough for concurrent callers to queue behind the running call
        return super().score(items)


@pytest.fixture(scope="module")
def served(tiny_policy, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    mp = pytest.MonkeyPatch()
    mp.setenv("PRORAG_DATA", str(data))
    model_dir, _ = tiny_policy
    prm, tok = prm_from_policy(model_dir, seed=1)
    save_pretrained(prm, tok, data / "prm-v1")
    prms = registry("prm", "tiny")
    prms.publish(data / "prm-v1", ArtifactRef.of("prm", "v1"))
    loop = LoopThread()
    engine = CountingEngine(prms.resolve("prm"), max_len=0)
    cfg = PRMServeConfig(model="prm", world="tiny", follow_latest_s=0.2, max_items=8, max_steps=4)
    started = loop.run(start(ServeConfig(port=0), cfg, engine=engine))
    with grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}") as ch:
        yield prm_pb2_grpc.ProcessRewardModelStub(ch), engine, prm, tok, data
    loop.run(started.stop())
    loop.close()
    mp.undo()


def _input(steps, last_only=False, question=Q):
    return prm_pb2.ScoringInput(question=question, steps=[step_pb(s) for s in steps], last_step_only=last_only)


def test_scores_every_step_like_the_engine_in_process(served):
    stub, engine, *_ = served
    resp = stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS), _input(STEPS[:2]),
                                                             _input(STEPS, last_only=True)]), timeout=30)
    assert resp.model_version == "prm@v1"
    full, two, last = [list(r.scores) for r in resp.results]
    assert len(full) == 3 and len(two) == 2 and len(last) == 1
    local = [s for _, s in engine.score([ScoringItem(Q, STEPS)])][0]
    assert full == pytest.approx(local, abs=1e-5)
    assert two == pytest.approx(full[:2], abs=1e-5)  # a step's score depends only on what came before it
    assert last == pytest.approx(full[2:], abs=1e-5)


def test_a_trajectory_longer_than_the_context_keeps_every_step(served):
    from prorag.search.pairs import prm_inputs

    _, engine, _, tok, _ = served
    long_doc = Document(id="d2", title="Long", text=" ".join(["filler"] * 300), contents="x")
    steps = [*STEPS[:2], Step("subquery", thought="Search.", content="Who founded Tova Lunn?", docs=[long_doc]),
             STEPS[2]]
    _, positions = prm_inputs(tok, Q, steps)
    saved = engine.max_len
    engine.max_len = positions[1] + 20  # the first two steps fit, the whole trajectory does not
    assert positions[-1] >= engine.max_len
    try:
        (_, cut), = engine.score([ScoringItem(Q, steps)])
    finally:
        engine.max_len = saved
    (_, whole), = engine.score([ScoringItem(Q, steps)])
    assert len(cut) == 4 and all(s == s for s in cut)  # every step scored, none NaN
    # the steps whose prefix fits are scored on their own prefix: exactly as without the limit
    assert cut[:2] == pytest.approx(whole[:2], abs=1e-5)


def test_concurrent_callers_share_engine_calls(served):
    stub, engine, *_ = served
    before, errors = CountingEngine.calls, []

    def call():
        try:
            stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
        except grpc.RpcError as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert CountingEngine.calls - before < 8


@pytest.mark.parametrize("request_, words", [
    (prm_pb2.ScoreStepsRequest(), "no trajectories"),
    (prm_pb2.ScoreStepsRequest(inputs=[_input([])]), "no steps"),
    (prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS, question=" ")]), "empty question"),
    (prm_pb2.ScoreStepsRequest(inputs=[prm_pb2.ScoringInput(question=Q, steps=[common_pb2.Step()])]), "empty step"),
    (prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)] * 9), "at most 8"),
    (prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS + STEPS)]), "at most 4"),
])
def test_bad_input_is_refused_and_the_server_keeps_serving(served, request_, words):
    stub, *_ = served
    with pytest.raises(grpc.RpcError) as ei:
        stub.ScoreSteps(request_, timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in ei.value.details()
    assert stub.GetModelInfo(prm_pb2.PrmInfoRequest(), timeout=10).model_id.startswith("prm@")


def test_hot_swap_of_a_newly_published_prm(served):
    stub, engine, prm, tok, data = served
    with torch.no_grad():
        prm.score.weight.mul_(-1.0)
    save_pretrained(prm, tok, data / "prm-v2")
    # Scored before the publish: the follower may swap within 0.2 s of it.
    r0 = stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
    assert r0.model_version == "prm@v1"
    before = list(r0.results[0].scores)
    time.sleep(0.05)  # a later creation time than v1's
    registry("prm", "tiny").publish(data / "prm-v2", ArtifactRef.of("prm", "v2"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        resp = stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
        if resp.model_version == "prm@v2":
            break
        time.sleep(0.1)
    assert resp.model_version == "prm@v2"
    after = list(resp.results[0].scores)
    assert after != pytest.approx(before, abs=1e-6)


def test_without_a_model_it_is_not_ready_and_says_why():
    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0), PRMServeConfig()))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}") as ch:
            with pytest.raises(grpc.RpcError) as ei:
                prm_pb2_grpc.ProcessRewardModelStub(ch).ScoreSteps(
                    prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no PRM is loaded" in ei.value.details()
    finally:
        loop.run(started.stop())
        loop.close()


def test_named_before_it_is_published_it_becomes_ready_at_the_first_publish(served):
    """A deployment names the PRM before stage 2 trained one: live, not ready, then serving once published."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, _, prm, tok, data = served
    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0), PRMServeConfig(model="later", world="tiny", follow_latest_s=0.2)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            stub = prm_pb2_grpc.ProcessRewardModelStub(ch)

            def ready():
                return health.Check(health_pb2.HealthCheckRequest(service="prorag.v1.ProcessRewardModel"),
                                    timeout=5).status == health_pb2.HealthCheckResponse.SERVING

            time.sleep(0.5)
            assert not ready()
            with pytest.raises(grpc.RpcError) as ei:
                stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            save_pretrained(prm, tok, data / "later-v1")
            registry("prm", "tiny").publish(data / "later-v1", ArtifactRef.of("later", "v1"))
            deadline = time.monotonic() + 30
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ready()
            resp = stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
            assert resp.model_version == "later@v1" and len(resp.results[0].scores) == len(STEPS)
    finally:
        loop.run(started.stop())
        loop.close()


def test_served_in_bfloat16_it_scores_as_float32_does_within_bf16_rounding(served, monkeypatch):
    """The PRM service on the device and dtype its config names (here the CPU in bf16: the path a GPU takes)."""
    from prorag.config import from_dict
    from prorag.training.devices import resolve

    _, engine, *_ = served
    cfg = from_dict(PRMServeConfig, {"model": str(engine.model_dir), "dtype": "bfloat16", "device": "cpu"})
    bf16 = PRMEngine(engine.model_dir, placement=resolve(cfg))
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    fp32_scores = engine.score([ScoringItem(Q, STEPS)])[0][1]
    bf16_scores = bf16.score([ScoringItem(Q, STEPS)])[0][1]
    assert bf16_scores == pytest.approx(fp32_scores, abs=0.05 + 0.02 * max(abs(x) for x in fp32_scores))


def test_a_gpu_the_host_lacks_is_refused_at_start(monkeypatch):
    from prorag.errors import FailedPrecondition

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loop = LoopThread()
    try:
        with pytest.raises(FailedPrecondition, match="no CUDA device"):
            loop.run(start(ServeConfig(port=0), PRMServeConfig(model="prm", world="tiny", device="cuda:0")))
    finally:
        loop.close()


def test_out_of_memory_fails_that_request_with_resource_exhausted_and_the_server_keeps_serving(served, monkeypatch):
    import services.prm.engine as prm_engine

    stub, *_ = served
    real = prm_engine.score_batch
    calls = []

    def oom_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:  # torch's own error, raised by hand: there is no GPU here to run out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(prm_engine, "score_batch", oom_once)
    with pytest.raises(grpc.RpcError) as ei:
        stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in ei.value.details() and "max_batch_tokens" in ei.value.details()
    resp = stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]), timeout=30)
    assert len(resp.results[0].scores) == len(STEPS)


class HeldEngine(PRMEngine):
    """The real engine, each call held until the test releases it: callers queue behind it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.entered, self.release, self.questions = threading.Event(), threading.Event(), []

    def score(self, items):
        self.questions += [it.question for it in items]
        self.entered.set()
        assert self.release.wait(60)
        return super().score(items)


class CountingHeldEngine(HeldEngine):
    """A HeldEngine that counts the calls inside it at once."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inside = self.most = 0
        self._count = threading.Lock()

    def score(self, items):
        with self._count:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            return super().score(items)
        finally:
            with self._count:
                self.inside -= 1


class _Held:
    """A PRM server on port 0 over a HeldEngine of the served PRM, with ``cfg`` settings."""

    def __init__(self, model_dir, engine_cls=HeldEngine, **cfg):
        self.engine = engine_cls(model_dir)
        self.loop = LoopThread()
        self.started = self.loop.run(start(ServeConfig(port=0), PRMServeConfig(model=str(model_dir), **cfg),
                                           engine=self.engine))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.started.grpc_port}")
        self.stub = prm_pb2_grpc.ProcessRewardModelStub(self.channel)

    def call_in_thread(self, request, timeout=60):
        box = {}

        def run():
            try:
                box["ok"] = self.stub.ScoreSteps(request, timeout=timeout)
            except grpc.RpcError as e:
                box["error"] = e
        t = threading.Thread(target=run)
        t.start()
        return t, box

    def close(self):
        self.engine.release.set()
        self.channel.close()
        self.loop.run(self.started.stop())
        self.loop.close()


def _wait_until(cond, what):
    """Polls a state the test waits for (not a timing assertion: a hung server fails here after a minute)."""
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def test_concurrent_callers_get_the_scores_each_gets_alone(served):
    """Trajectories of different lengths merged into one engine call and padded to the longest: every score is the
    one its trajectory gets alone."""
    stub, engine, *_ = served
    other = [Step("subquery", thought="Next the city.", content="Where was Tova Lunn born?", docs=[DOC]),
             Step("subanswer", thought="Not in the document.", content="unknown")]
    requests = [prm_pb2.ScoreStepsRequest(inputs=[_input(s, question=q)])
                for s, q in [(STEPS, Q), (STEPS[:1], Q), (other, "Where was the founder of Mai Brewery born?"),
                             (STEPS[:2], "Who started Mai Brewery?")] * 3]
    alone = [list(stub.ScoreSteps(r, timeout=30).results[0].scores) for r in requests]
    before, out, errors = CountingEngine.calls, [None] * len(requests), []

    def call(k):
        try:
            out[k] = list(stub.ScoreSteps(requests[k], timeout=30).results[0].scores)
        except grpc.RpcError as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert CountingEngine.calls - before < len(requests)  # merged (the engine holds each call 50 ms)
    for got, want in zip(out, alone):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_full_queue_refuses_with_resource_exhausted_and_the_server_keeps_serving(served):
    _, engine, *_ = served
    s = _Held(engine.model_dir, max_queue_steps=4)
    try:
        req = prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)])  # 3 steps
        first, first_box = s.call_in_thread(req)
        _wait_until(s.engine.entered.is_set, "ran the first request")
        second, second_box = s.call_in_thread(req)  # queued: 3 of the 4 steps the queue holds
        depth = lambda: REGISTRY.get_sample_value("prorag_batcher_queue_weight", {"batcher": "prm"})  # noqa: E731
        _wait_until(lambda: depth() == 3, "queued the second request")
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.ScoreSteps(req, timeout=30)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 steps already queued" in ei.value.details() and "retry with backoff" in ei.value.details()
        s.engine.release.set()
        first.join()
        second.join()
        assert "ok" in first_box and "ok" in second_box
        resp = s.stub.ScoreSteps(req, timeout=30)  # still serving
        assert list(resp.results[0].scores) == pytest.approx(list(first_box["ok"].results[0].scores), abs=1e-5)
    finally:
        s.close()


def test_a_deadline_that_passes_in_the_queue_gives_deadline_exceeded_and_is_never_scored(served):
    _, engine, *_ = served
    s = _Held(engine.model_dir)
    try:
        first, first_box = s.call_in_thread(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS)]))
        _wait_until(s.engine.entered.is_set, "ran the first request")
        late = prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS, question="Who owns Mai Brewery?")])
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.ScoreSteps(late, timeout=0.5)  # queued behind the held call until its deadline passes
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        s.engine.release.set()
        first.join()
        assert "ok" in first_box
        resp = s.stub.ScoreSteps(prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS[:2])]), timeout=30)
        assert len(resp.results[0].scores) == 2
        assert "Who owns Mai Brewery?" not in s.engine.questions  # dropped from the queue, not scored late
    finally:
        s.close()


def test_with_two_engine_workers_two_calls_run_at_once_and_each_scores_as_alone(served):
    _, engine, *_ = served
    s = _Held(engine.model_dir, engine_cls=CountingHeldEngine, engine_workers=2)
    try:
        requests = [prm_pb2.ScoreStepsRequest(inputs=[_input(STEPS[:n], question=f"Who founded Mai Brewery {n}?")])
                    for n in (1, 2, 3)]
        # one at a time, so that two arriving together are not merged into one call: two calls inside the engine
        # at once, the third queued behind them (one worker each)
        calls = [s.call_in_thread(requests[0])]
        _wait_until(lambda: s.engine.inside == 1, "ran the first call")
        calls.append(s.call_in_thread(requests[1]))
        _wait_until(lambda: s.engine.most == 2, "ran two calls at once")
        calls.append(s.call_in_thread(requests[2]))
        depth = lambda: REGISTRY.get_sample_value("prorag_batcher_queue_depth", {"batcher": "prm"})  # noqa: E731
        _wait_until(lambda: depth() == 1, "queued the third request")
        assert s.engine.inside == 2
        s.engine.release.set()
        for t, _ in calls:
            t.join()
        plain = PRMEngine(engine.model_dir)
        for r, (_, box) in zip(requests, calls):
            alone = plain.score([ScoringItem(r.inputs[0].question, STEPS[:len(r.inputs[0].steps)])])[0][1]
            assert list(box["ok"].results[0].scores) == pytest.approx(alone, abs=1e-5)
    finally:
        s.close()
