"""Batching concurrent callers together (one engine call for many requests).

Requests arriving while the engine is busy queue up; when it frees, every queued
request with the same grouping key is merged into a single engine call, up to
``max_items`` (counted by ``weight``: items by default, a PRM counts steps). Under load this turns N small calls
into one large one, which is what makes a CPU/GPU encoder efficient; when idle a request runs at once (no
fixed waiting window, so single-caller latency is unchanged); ``max_wait_s`` lets a batch gather a moment longer
only while callers are seen to overlap.

Admission: the queue is bounded in requests (``max_queue``) and in pending weight (``max_queue_weight``), past
either a caller is refused with RESOURCE_EXHAUSTED at once rather than queued behind a wait that only grows; a
request whose deadline has passed, or cannot be met behind the weight already queued at the rate the engine has
been measured to drain it, is refused with DEADLINE_EXCEEDED and never runs.

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
QUEUE_WEIGHT = Gauge("prorag_batcher_queue_weight", "Weight waiting for an engine call (items; steps for the PRM)",
                     ["batcher"])
BATCH_WEIGHT = Histogram("prorag_batcher_batch_weight", "Weight (items; steps for the PRM) in one merged engine call",
                         ["batcher"], buckets=_SIZES + (8192, 16384, 32768))
REJECTED = Counter("prorag_batcher_rejected_total", "Requests refused before an engine call ran them: queue_full "
                   "(RESOURCE_EXHAUSTED), deadline (passed, or cannot be met behind the queue: DEADLINE_EXCEEDED)",
                   ["batcher", "reason"])
#: weight of a just-measured call against the running rate (an exponential moving average of weight per second)
_RATE_SMOOTHING = 0.3


@dataclass
class _Pending:
    key: Hashable
    items: Sequence[Any]
    deadline: float | None
    future: asyncio.Future
    weight: int = 1
    enqueued: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """``await batcher.submit(key, items, deadline)`` -> ``fn(key, merged_items)[slice]``.

    ``fn(key, items) -> list`` runs in a worker thread and returns one result per item.
    ``weight(items) -> int``: a request's cost (default: its item count); ``max_items`` caps the weight of one merged
    call (a single larger request still runs, alone).
    ``max_queue`` bounds the number of waiting requests, ``max_queue_weight`` their weight (RESOURCE_EXHAUSTED past
    either; a request reaching an empty queue is always taken).
    ``max_wait_s``: while the last call merged several requests (callers overlap), wait up to this long for more
    before dispatching a call below ``max_items``; 0 never waits.
    ``concurrency``: merged calls in flight at once. 1 (an engine that batches only what one call hands it: requests
    arriving while it runs wait and are merged into the next call); more for an engine that schedules concurrent
    calls itself (vLLM's continuous batching), so callers with different keys do not take turns.
    """

    def __init__(self, fn: Callable[[Hashable, list], list], max_items: int = 1024,
                 max_queue: int = 4096, name: str = "batcher", concurrency: int = 1,
                 weight: Callable[[Sequence[Any]], int] | None = None, max_queue_weight: int | None = None,
                 max_wait_s: float = 0.0, what: str = "items"):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._fn = fn
        self._max_items = max_items
        self._max_queue = max_queue
        self._weight = weight or len
        self._max_queue_weight = max_queue_weight
        self._max_wait_s = max_wait_s
        self._what = what  # the unit of weight, in refusals' messages
        self._queued_weight = 0
        self._rate: float | None = None  # weight per second the engine has drained, once measured
        self._overlapping = False  # the last call merged more than one request
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
        self._queued = QUEUE_WEIGHT.labels(name)

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
        w = int(self._weight(items))
        queued = self._queued_weight
        if self._pending and len(self._pending) >= self._max_queue:
            REJECTED.labels(self.name, "queue_full").inc()
            raise ResourceExhausted(f"server busy: {len(self._pending)} requests already queued; retry with backoff")
        if self._pending and self._max_queue_weight is not None and queued + w > self._max_queue_weight:
            REJECTED.labels(self.name, "queue_full").inc()
            raise ResourceExhausted(
                f"server busy: {queued} {self._what} already queued and this request brings {w}, past the queue's "
                f"bound of {self._max_queue_weight}; retry with backoff, or send fewer {self._what} per request")
        if deadline is not None:
            now = time.monotonic()
            if deadline <= now:
                REJECTED.labels(self.name, "deadline").inc()
                raise DeadlineExceeded("the deadline had passed when the request reached the queue")
            # the queue ahead drains at the measured rate at best (merging cannot beat it by much), on every slot
            # at once: a caller that cannot be answered in time is told now, rather than after waiting its whole
            # deadline
            drain = (self._rate or 0.0) * self._concurrency
            if drain and queued and now + queued / drain > deadline:
                REJECTED.labels(self.name, "deadline").inc()
                raise DeadlineExceeded(
                    f"{queued} {self._what} are queued ahead, about {queued / drain:.2f}s of work at the "
                    f"measured {drain:.0f} {self._what}/s; the deadline leaves {deadline - now:.2f}s: retry "
                    "later or with a longer deadline")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(key, items, deadline, fut, weight=w))
        self._set_queued()
        self._wakeup.set()
        return await fut

    def _set_queued(self) -> None:
        self._queued_weight = sum(p.weight for p in self._pending)
        self._depth.set(len(self._pending))
        self._queued.set(self._queued_weight)

    def _take_group(self) -> tuple[Hashable, list[_Pending]]:
        now = time.monotonic()
        live = []
        for p in self._pending:
            if p.future.done():
                continue  # caller went away (cancelled: its deadline passed, or it hung up)
            if p.deadline is not None and p.deadline <= now:
                REJECTED.labels(self.name, "deadline").inc()
                p.future.set_exception(DeadlineExceeded(
                    f"deadline passed after {now - p.enqueued:.3f}s in the queue, before the engine ran it"))
                continue
            live.append(p)
        self._pending = live
        if not live:
            self._set_queued()
            return None, []
        key = live[0].key
        group, rest, n = [], [], 0
        for p in live:
            if p.key == key and (not group or n + p.weight <= self._max_items):
                group.append(p)
                n += p.weight
            else:
                rest.append(p)
        self._pending = rest
        self._set_queued()
        return key, group

    def _group_weight_ready(self) -> bool:
        """Whether the first key's queued weight already fills a call (no point waiting for more)."""
        if not self._pending:
            return False
        key = self._pending[0].key
        return sum(p.weight for p in self._pending if p.key == key and not p.future.done()) >= self._max_items

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            # a free slot first: with every slot busy, new requests keep queueing and are merged when one frees
            await self._slots.acquire()
            if self._max_wait_s > 0 and self._overlapping:
                # callers overlap: those answered by the last call are sending their next requests now, and a
                # call dispatched at once would take the first one alone and leave the rest for the next
                until = loop.time() + self._max_wait_s
                while not self._group_weight_ready() and loop.time() < until:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), until - loop.time())
                    except asyncio.TimeoutError:
                        break
            key, group = self._take_group()
            if not group:
                self._slots.release()
                continue
            task = loop.create_task(self._dispatch(loop, key, group))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, loop, key, group: list[_Pending]) -> None:
        merged = [item for p in group for item in p.items]
        weight = sum(p.weight for p in group)
        BATCH_ITEMS.labels(self.name).observe(len(merged))
        BATCH_REQUESTS.labels(self.name).observe(len(group))
        BATCH_WEIGHT.labels(self.name).observe(weight)
        self._overlapping = len(group) > 1
        t0 = time.monotonic()
        try:
            results = await loop.run_in_executor(self._executor, self._fn, key, merged)
            took = time.monotonic() - t0
            if took > 0:
                r = weight / took
                self._rate = r if self._rate is None else (1 - _RATE_SMOOTHING) * self._rate + _RATE_SMOOTHING * r
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
