"""Thin gRPC servicer for prorag.v1.Judge: validate, convert, call the engine (off the event loop)."""

from __future__ import annotations

import asyncio

from prorag.errors import InvalidArgument
from prorag.pb import judge_pb2, judge_pb2_grpc
from prorag.rpc.pbconv import step_from_pb
from services.judge.engine import PairRequest


class JudgeServicer(judge_pb2_grpc.JudgeServicer):
    def __init__(self, engine, max_items: int, max_candidates: int):
        self.engine, self.max_items, self.max_candidates = engine, max_items, max_candidates

    def _items(self, request) -> list[PairRequest]:
        if not request.items:
            raise InvalidArgument("no items to judge")
        if len(request.items) > self.max_items:
            raise InvalidArgument(f"{len(request.items)} items in one request; at most {self.max_items} "
                                  "(split the request)")
        items = []
        for k, it in enumerate(request.items):
            name = it.id or f"#{k}"
            if not it.question.strip() and not it.question_id:
                raise InvalidArgument(f"item {name}: no question and no question_id")
            if not 2 <= len(it.candidates) <= self.max_candidates:
                raise InvalidArgument(f"item {name}: {len(it.candidates)} candidates; a pair needs 2 to "
                                      f"{self.max_candidates} sibling steps")
            cands = [step_from_pb(c.step) for c in it.candidates]
            if any(not (c.text.strip() or c.content.strip()) for c in cands):
                raise InvalidArgument(f"item {name}: an empty candidate step (no text and no content)")
            items.append(PairRequest(name, it.question_id, it.question, [step_from_pb(s) for s in it.history], cands))
        return items

    async def JudgePairs(self, request, context):
        items = self._items(request)
        results = await asyncio.to_thread(self.engine.judge, items)
        return judge_pb2.JudgePairsResponse(verdicts=[
            judge_pb2.Verdict(id=r.id, chosen=r.chosen, rejected=r.rejected, rationale=r.rationale,
                              cached=r.cached, backend=self.engine.backend)
            for r in results])

    async def GetJudgeInfo(self, request, context):
        info = self.engine.info()
        return judge_pb2.JudgeInfo(backend=self.engine.backend, model=self.engine.model,
                                   cache_entries=info["cache_entries"], calls_made=info["calls_made"],
                                   budget_left_usd=info["budget_left_usd"])
