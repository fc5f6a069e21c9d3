"""The judge's request path: every check of a request and the limits it is held to, then the engine's judgement
(off the event loop: the reference judge reads files, the OpenAI one waits on HTTP). The engine trusts what
reaches it."""

from __future__ import annotations

import asyncio
from typing import Sequence

from prorag.errors import InvalidArgument
from services.judge.engine import Judgement, PairRequest


class JudgingFrontend:
    def __init__(self, engine, max_items: int, max_candidates: int):
        self.engine, self.max_items, self.max_candidates = engine, max_items, max_candidates

    def check(self, items: Sequence[PairRequest]) -> None:
        if not items:
            raise InvalidArgument("no items to judge")
        if len(items) > self.max_items:
            raise InvalidArgument(f"{len(items)} items in one request; at most {self.max_items} (split the request)")
        for it in items:
            if not it.question.strip() and not it.question_id:
                raise InvalidArgument(f"item {it.id}: no question and no question_id")
            if not 2 <= len(it.candidates) <= self.max_candidates:
                raise InvalidArgument(f"item {it.id}: {len(it.candidates)} candidates; a pair needs 2 to "
                                      f"{self.max_candidates} sibling steps")
            if any(not (c.text.strip() or c.content.strip()) for c in it.candidates):
                raise InvalidArgument(f"item {it.id}: an empty candidate step (no text and no content)")

    async def judge(self, items: Sequence[PairRequest]) -> list[Judgement]:
        self.check(items)
        return await asyncio.to_thread(self.engine.judge, items)

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def model(self) -> str:
        return self.engine.model

    def info(self) -> dict:
        return self.engine.info()
