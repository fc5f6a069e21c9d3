"""The judge service (reference backend) as a real gRPC server on port 0 on loopback: it labels sibling steps
by ProRAG's rules against the gold decomposition, refuses bad input with the right status and keeps serving."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag.errors import NotFound
from prorag.pb import common_pb2, judge_pb2, judge_pb2_grpc
from prorag.rpc.pbconv import step_pb
from prorag.rpc.service import ServeConfig
from prorag.trajectory import Step
from services.judge.engine import ReferenceJudge
from services.judge.server import JudgeConfig, start
from tests.helpers import LoopThread
from tests.search.test_judging import DOC1, Q, SEARCH1


@pytest.fixture(scope="module")
def judge():
    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0), JudgeConfig(max_items=4, max_candidates=3),
                             engine=ReferenceJudge([Q])))
    with grpc.insecure_channel(f"127.0.0.1:{started.grpc_port}") as ch:
        yield judge_pb2_grpc.JudgeStub(ch), ch
    loop.run(started.stop())
    loop.close()


def _item(candidates, history=(), **kw):
    return judge_pb2.JudgeItem(id=kw.pop("id", "p1"), question=kw.pop("question", Q.question),
                               history=[step_pb(s) for s in history],
                               candidates=[judge_pb2.Candidate(step=step_pb(c)) for c in candidates], **kw)


def test_labels_pairs_by_the_rules(judge):
    stub, ch = judge
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="prorag.v1.Judge"), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    wrong = Step("subquery", content="Who founded Tova Lunn?")
    unsupported = Step("subanswer", content="Kora Vell")
    right = Step("subanswer", content="Tova Lunn")
    resp = stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[
        _item([wrong, SEARCH1], id="a"),
        _item([unsupported, right], history=[SEARCH1], id="b", question_id="q1", question=""),
        _item([SEARCH1, SEARCH1], id="c")]), timeout=10)
    a, b, c = resp.verdicts
    assert (a.id, a.chosen, a.rejected) == ("a", 1, 0) and "wrong entity" in a.rationale
    assert (b.chosen, b.rejected) == (1, 0) and b.backend == "reference"
    assert (c.chosen, c.rejected) == (-1, -1)  # both sound: the judge declines
    # a step given only as text is parsed
    raw = _item([SEARCH1, wrong])
    raw.candidates[1].step.Clear()
    raw.candidates[1].step.text = "Wrong.</step>\n<subquery>\nWho founded Tova Lunn?</subquery>"
    assert stub.JudgePairs(judge_pb2.JudgePairsRequest(items=[raw]), timeout=10).verdicts[0].chosen == 0
    info = stub.GetJudgeInfo(judge_pb2.JudgeInfoRequest(), timeout=5)
    assert info.backend == "reference" and info.calls_made >= 2


@pytest.mark.parametrize("request_, code, words", [
    (judge_pb2.JudgePairsRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no items"),
    (judge_pb2.JudgePairsRequest(items=[_item([SEARCH1])]), grpc.StatusCode.INVALID_ARGUMENT, "2 to 3"),
    (judge_pb2.JudgePairsRequest(items=[_item([SEARCH1] * 4)]), grpc.StatusCode.INVALID_ARGUMENT, "2 to 3"),
    (judge_pb2.JudgePairsRequest(items=[_item([SEARCH1, SEARCH1])] * 5), grpc.StatusCode.INVALID_ARGUMENT, "at most 4"),
    (judge_pb2.JudgePairsRequest(items=[_item([SEARCH1, Step("answer", content="x")], question="Who is Bob?")]),
     grpc.StatusCode.NOT_FOUND, "not in the served world"),
    (judge_pb2.JudgePairsRequest(items=[judge_pb2.JudgeItem(id="e", question=Q.question, candidates=[
        judge_pb2.Candidate(step=common_pb2.Step()), judge_pb2.Candidate(step=step_pb(SEARCH1))])]),
     grpc.StatusCode.INVALID_ARGUMENT, "empty candidate"),
])
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(judge, request_, code, words):
    stub, _ = judge
    with pytest.raises(grpc.RpcError) as ei:
        stub.JudgePairs(request_, timeout=10)
    assert ei.value.code() == code and words in ei.value.details()
    assert stub.GetJudgeInfo(judge_pb2.JudgeInfoRequest(), timeout=5).backend == "reference"


def test_reference_judge_needs_a_world(tmp_path):
    with pytest.raises(NotFound):
        ReferenceJudge.from_world(tmp_path)
