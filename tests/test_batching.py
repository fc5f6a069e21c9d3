import asyncio
import threading
import time

import pytest

from prorag.batching import MicroBatcher
from prorag.errors import DeadlineExceeded, ResourceExhausted


def test_concurrent_callers_are_merged_and_results_split():
    calls = []
    gate = threading.Event()

    def fn(key, items):
        calls.append((key, list(items)))
        gate.wait(5)  # hold the first call so the others queue up behind it
        return [f"{key}:{x}" for x in items]

    async def main():
        b = MicroBatcher(fn, max_items=100)
        first = asyncio.create_task(b.submit("k", [0]))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(b.submit("k", [i, i + 100])) for i in range(1, 6)]
        other = asyncio.create_task(b.submit("z", [7]))
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.gather(first, *rest, other)
        await b.close()
        return out, b

    out, b = asyncio.run(main())
    assert out[0] == ["k:0"]
    for i in range(1, 6):
        assert out[i] == [f"k:{i}", f"k:{i + 100}"]
    assert out[6] == ["z:7"]
    # 1 call for the first request, 1 merged call for the five queued, 1 for the other key
    assert len(calls) == 3
    assert calls[1] == ("k", [1, 101, 2, 102, 3, 103, 4, 104, 5, 105])


def test_max_items_splits_groups():
    sizes = []

    def fn(key, items):
        sizes.append(len(items))
        time.sleep(0.02)
        return list(items)

    async def main():
        b = MicroBatcher(fn, max_items=4)
        tasks = [asyncio.create_task(b.submit("k", [i, i])) for i in range(6)]
        out = await asyncio.gather(*tasks)
        await b.close()
        return out

    out = asyncio.run(main())
    assert out == [[i, i] for i in range(6)]
    assert max(sizes) <= 4 and sum(sizes) == 12


def test_expired_deadline_fails_without_running():
    ran = []

    def fn(key, items):
        ran.append(items)
        return list(items)

    async def main():
        b = MicroBatcher(fn)
        with pytest.raises(DeadlineExceeded):
            await b.submit("k", [1], deadline=time.monotonic() - 1)
        ok = await b.submit("k", [2], deadline=time.monotonic() + 10)
        await b.close()
        return ok

    assert asyncio.run(main()) == [2]
    assert ran == [[2]]


def test_engine_error_reaches_callers_and_batcher_keeps_working():
    def fn(key, items):
        if "bad" in items:
            raise ValueError("boom")
        return list(items)

    async def main():
        b = MicroBatcher(fn)
        with pytest.raises(ValueError, match="boom"):
            await b.submit("k", ["bad"])
        ok = await b.submit("k", ["good"])
        await b.close()
        return ok

    assert asyncio.run(main()) == ["good"]


def test_queue_bound():
    gate = threading.Event()

    def fn(key, items):
        gate.wait(5)
        return list(items)

    async def main():
        b = MicroBatcher(fn, max_queue=2)
        t1 = asyncio.create_task(b.submit("k", [1]))
        await asyncio.sleep(0.05)  # t1 is running, queue empty
        t2 = asyncio.create_task(b.submit("k", [2]))
        t3 = asyncio.create_task(b.submit("k", [3]))
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            await b.submit("k", [4])
        gate.set()
        out = await asyncio.gather(t1, t2, t3)
        await b.close()
        return out

    assert asyncio.run(main()) == [[1], [2], [3]]
