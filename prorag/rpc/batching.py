"""Batching concurrent callers together (one engine call for many requests).

Requests arriving while the engine is busy queue up; when it frees, every queued
request with the same grouping key is merged into a single engine call, up to
``max_items``. Under load this turns N small calls into one large one, which is
what makes a CPU/GPU encoder efficient; when idle a request runs at once (no
fixed waiting window, so single-caller latency is unchanged).

Written here rather than taken from a library because the merge key, per-request
deadlines and result splitting are specific to our RPCs and fit in a page.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from prometheus_client import Counter, Gauge, Histogram

from prorag.errors import DeadlineExceeded, ResourceExhausted

_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BATCH_ITEMS = Histogram("prorag_batcher_batch_items", "Items (queries, prompts, trajectories) in one merged engine "
                        "call", ["batcher"], buckets=_SIZES)
BATCH_REQUESTS = Histogram("prorag_batcher_batch_requests", "Caller requests merged into one engine call",
                           ["batcher"], buckets=_SIZES)
QUEUE_DEPTH = Gauge("prorag_batcher_queue_depth", "Requests waiting for an engine call", ["batcher"])
REJECTED = Counter("prorag_batcher_rejected_total", "Requests refused before an engine call ran them: queue_full "
                   "(RESOURCE_EXHAUSTED) or deadline (passed while queued)", ["batcher", "reason"])


@dataclass
class _Pending:
    key: Hashable
    items: Sequence[Any]
    deadline: float | None
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """``await batcher.submit(key, items, deadline)`` -> ``fn(key, merged_items)[slice]``.

    ``fn(key, items) -> list`` runs in a worker thread and returns one result per item.
    ``max_queue`` bounds the number of waiting requests (RESOURCE_EXHAUSTED past it).
    ``concurrency``: merged calls in flight at once. 1 (an engine that batches only what one call hands it: requests
    arriving while it runs wait and are merged into the next call); more for an engine that schedules concurrent
    calls itself (vLLM's continuous batching), so callers with different keys do not take turns.
    """

    def __init__(self, fn: Callable[[Hashable, list], list], max_items: int = 1024,
                 max_queue: int = 4096, name: str = "batcher", concurrency: int = 1):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._fn = fn
        self._max_items = max_items
        self._max_queue = max_queue
        self._pending: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=name)
        self._concurrency = concurrency
        self._slots: asyncio.Semaphore | None = None  # made on the running loop
        self._running: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self.calls = 0
        self.requests = 0
        self.name = name
        self._depth = QUEUE_DEPTH.labels(name)

    def start(self) -> None:
        if self._task is None:
            self._slots = asyncio.Semaphore(self._concurrency)
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for t in list(self._running):
            t.cancel()
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(asyncio.CancelledError())
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, key: Hashable, items: Sequence[Any], deadline: float | None = None) -> list:
        """Queue ``items``; ``deadline`` is an absolute time.monotonic() value or None."""
        self.start()
        if len(self._pending) >= self._max_queue:
            REJECTED.labels(self.name, "queue_full").inc()
            raise ResourceExhausted(f"server busy: {len(self._pending)} requests already queued; retry with backoff")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(key, items, deadline, fut))
        self._depth.set(len(self._pending))
        self._wakeup.set()
        return await fut

    def _take_group(self) -> tuple[Hashable, list[_Pending]]:
        now = time.monotonic()
        live = []
        for p in self._pending:
            if p.future.done():
                continue  # caller went away (cancelled)
            if p.deadline is not None and p.deadline <= now:
                REJECTED.labels(self.name, "deadline").inc()
                p.future.set_exception(DeadlineExceeded(
                    f"deadline passed after {now - p.enqueued:.3f}s in the queue, before the search ran"))
                continue
            live.append(p)
        self._pending = live
        if not live:
            self._depth.set(0)
            return None, []
        key = live[0].key
        group, rest, n = [], [], 0
        for p in live:
            if p.key == key and (not group or n + len(p.items) <= self._max_items):
                group.append(p)
                n += len(p.items)
            else:
                rest.append(p)
        self._pending = rest
        self._depth.set(len(rest))
        return key, group

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            # a free slot first: with every slot busy, new requests keep queueing and are merged when one frees
            await self._slots.acquire()
            key, group = self._take_group()
            if not group:
                self._slots.release()
                continue
            task = loop.create_task(self._dispatch(loop, key, group))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, loop, key, group: list[_Pending]) -> None:
        merged = [item for p in group for item in p.items]
        BATCH_ITEMS.labels(self.name).observe(len(merged))
        BATCH_REQUESTS.labels(self.name).observe(len(group))
        try:
            results = await loop.run_in_executor(self._executor, self._fn, key, merged)
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of this batch
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self._slots.release()
        self.calls += 1
        self.requests += len(group)
        offset = 0
        for p in group:
            if not p.future.done():
                p.future.set_result(results[offset:offset + len(p.items)])
            offset += len(p.items)
