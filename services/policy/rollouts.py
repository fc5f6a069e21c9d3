"""Running admitted rollouts: ProRAG's search loop (prorag.rollout) on a worker thread per request, over the
scheduler's engine and the retriever, each trajectory streamed back as it finishes. Requests reach here checked
(services.policy.frontend)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from prorag.engine import SamplingSpec
from prorag.errors import Cancelled, DeadlineExceeded
from prorag.rollout import TrajectoryResult, run_rollouts
from services.policy.manager import AdapterManager
from services.policy.retriever_client import RetrieverSearch
from services.policy.scheduler import GenerationScheduler


@dataclass(frozen=True)
class RolloutSummary:
    """What one Rollout request did, sent after its last trajectory."""

    num_trajectories: int
    generated_tokens: int
    wall_s: float
    adapter_version: str
    searches_asked: int
    searches_made: int


class RolloutGuard:
    """Stops a rollout between engine and retriever calls once its caller has gone or its deadline passed,
    so neither a cancelled nor an overdue rollout keeps the engine busy (each engine call is itself
    bounded by max_tokens)."""

    def __init__(self, engine, search, deadline: float | None):
        self.engine, self._search, self.deadline = engine, search, deadline
        self.cancelled = threading.Event()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.rounds = 0

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled("the caller cancelled the rollout")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"the rollout ran past its deadline after {self.rounds} engine calls; "
                                   "give it a longer deadline or fewer questions")

    def generate(self, prompts, params, adapter=None, seeds=None):
        self.check()
        self.rounds += 1
        return self.engine.generate(prompts, params, adapter, seeds)

    def search(self, queries, topk):
        self.check()
        return self._search(queries, topk)

    def __getattr__(self, name):  # the rest of the engine interface (info, adapters, ...)
        return getattr(self.engine, name)


class RolloutRunner:
    def __init__(self, scheduler: GenerationScheduler, manager: AdapterManager, retriever: RetrieverSearch,
                 tokenizer, max_concurrent: int):
        self.scheduler, self.manager, self.retriever, self.tokenizer = scheduler, manager, retriever, tokenizer
        # more admitted requests than workers wait here, in order (the queue the front end admits into)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="rollout")

    async def run(self, questions: Sequence[tuple[str, str]], spec: SamplingSpec, *, max_steps: int, topk: int,
                  retriever_index: str, adapter: str, deadline: float | None,
                  question_offset: int = 0) -> AsyncIterator[tuple[TrajectoryResult, str] | RolloutSummary]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # in this context: the request id goes along
        await asyncio.to_thread(self.retriever.check_index, retriever_index)
        started = time.monotonic()
        with self.manager.acquire(adapter) as resolved:
            guard = RolloutGuard(self.scheduler.sync_engine(deadline),
                                 self.retriever.search_fn(retriever_index, deadline), deadline)
            version = resolved or ""
            searches: dict = {}

            def work():
                return run_rollouts(guard, self.tokenizer, [(qid or str(i), q) for i, (qid, q) in enumerate(questions)],
                                    spec, guard.search, max_steps=max_steps, topk=topk, adapter=resolved,
                                    on_finished=lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                                    stats=searches, question_offset=question_offset)

            # the copied context carries the request id to the retriever calls made from the rollout's thread
            fut = loop.run_in_executor(self._pool, contextvars.copy_context().run, work)
            fut.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
            total = len(questions) * spec.n
            sent, tokens = 0, 0
            try:
                while sent < total:
                    item = await queue.get()
                    if item is None:
                        break
                    sent += 1
                    tokens += item.tokens.generated_tokens
                    yield item, version
                await fut  # re-raises a failure of the rollout (mapped by the interceptor)
            finally:
                if not fut.done():
                    # The caller went away (cancelled, deadline, disconnected): stop the work at its next
                    # engine or retriever call instead of finishing every question for nobody.
                    guard.cancelled.set()
        yield RolloutSummary(num_trajectories=sent, generated_tokens=tokens, wall_s=time.monotonic() - started,
                             adapter_version=version, searches_asked=searches.get("searches_asked", 0),
                             searches_made=searches.get("searches_made", 0))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
