"""Thin gRPC servicer for prorag.v1.Judge: convert, call the front end (which checks, then runs the engine)."""

from __future__ import annotations

from prorag.pb import judge_pb2, judge_pb2_grpc
from prorag.rpc.pbconv import step_from_pb
from services.judge.engine import PairRequest
from services.judge.frontend import JudgingFrontend


def pair_request(k: int, item: judge_pb2.JudgeItem) -> PairRequest:
    """Item ``k`` of a request; one without an id is named by its place (#k) in messages and verdicts."""
    return PairRequest(item.id or f"#{k}", item.question_id, item.question, [step_from_pb(s) for s in item.history],
                       [step_from_pb(c.step) for c in item.candidates])


class JudgeServicer(judge_pb2_grpc.JudgeServicer):
    def __init__(self, frontend: JudgingFrontend):
        self.frontend = frontend

    async def JudgePairs(self, request, context):
        results = await self.frontend.judge([pair_request(k, it) for k, it in enumerate(request.items)])
        return judge_pb2.JudgePairsResponse(verdicts=[
            judge_pb2.Verdict(id=r.id, chosen=r.chosen, rejected=r.rejected, rationale=r.rationale,
                              cached=r.cached, backend=self.frontend.backend)
            for r in results])

    async def GetJudgeInfo(self, request, context):
        info = self.frontend.info()
        return judge_pb2.JudgeInfo(backend=self.frontend.backend, model=self.frontend.model,
                                   cache_entries=info["cache_entries"], calls_made=info["calls_made"],
                                   budget_left_usd=info["budget_left_usd"])
