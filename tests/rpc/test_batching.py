import asyncio
import threading
import time

import pytest

from prorag.rpc.batching import MicroBatcher
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


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_lets_calls_of_different_keys_run_together_and_one_keeps_them_in_turn(concurrency):
    """vLLM batches concurrent calls itself (concurrency > 1); the transformers engine merges callers into its next
    call (concurrency 1): requests arriving while every slot is busy still merge."""
    running, peak, lock = [0], [0], threading.Lock()
    calls = []

    def fn(key, items):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            calls.append((key, list(items)))
        time.sleep(0.15)
        with lock:
            running[0] -= 1
        return [f"{key}:{x}" for x in items]

    async def main():
        b = MicroBatcher(fn, concurrency=concurrency)
        tasks = [asyncio.create_task(b.submit(k, [k])) for k in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        late = [asyncio.create_task(b.submit("d", [i])) for i in range(4)]  # all slots may be busy now
        out = await asyncio.gather(*tasks, *late)
        await b.close()
        return out

    out = asyncio.run(main())
    assert out[:3] == [["a:a"], ["b:b"], ["c:c"]] and out[3:] == [[f"d:{i}"] for i in range(4)]
    assert peak[0] == concurrency
    assert ("d", [0, 1, 2, 3]) in calls  # the late callers of one key were merged into one call


def test_the_policy_scheduler_gives_vllm_concurrent_calls_and_transformers_one():
    from services.policy.scheduler import GenerationScheduler
    from services.policy.vllm_engine import VLLMEngine

    class Plain:
        tokenizer, max_model_len = None, 0

    assert GenerationScheduler(Plain()).batcher._concurrency == 1
    assert VLLMEngine.concurrent_calls > 1
    vllm_like = Plain()
    vllm_like.concurrent_calls = VLLMEngine.concurrent_calls
    assert GenerationScheduler(vllm_like).batcher._concurrency == VLLMEngine.concurrent_calls


def test_the_queue_is_bounded_by_weight_and_a_request_past_it_is_refused_with_what_to_do():
    gate = threading.Event()
    sizes = []

    def fn(key, items):
        gate.wait(5)
        sizes.append(sum(items))
        return list(items)

    async def main():
        # each item weighs its value (a PRM weighs its steps)
        b = MicroBatcher(fn, max_items=10, max_queue_weight=6, weight=sum, what="steps")
        running = asyncio.create_task(b.submit("k", [9]))  # taken at once, whatever its weight
        while b._pending or not b._running:
            await asyncio.sleep(0.01)
        queued = [asyncio.create_task(b.submit("k", [2])), asyncio.create_task(b.submit("k", [4]))]
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="6 steps already queued and this request brings 1.*retry"):
            await b.submit("k", [1])
        gate.set()
        out = await asyncio.gather(running, *queued)
        after = await b.submit("k", [7])  # served again once the queue drained
        await b.close()
        return out, after

    out, after = asyncio.run(main())
    assert out == [[9], [2], [4]] and after == [7]
    assert sizes == [9, 6, 7]  # the two queued requests merged into one call of weight 6


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once():
    """Refused when the queue ahead would take longer than the deadline leaves, at the rate measured so far. The
    first call is held at least 0.3 s, so the measured rate is at most 1 / 0.3 units per second: 10 units queued
    take 3 s or more, past a 2 s deadline, however fast the machine."""
    gate = threading.Event()
    ran = []

    def fn(key, items):
        gate.wait(5)
        ran.append(list(items))
        return list(items)

    async def main():
        b = MicroBatcher(fn, max_items=100)
        first = asyncio.create_task(b.submit("k", [0]))
        await asyncio.sleep(0.3)
        gate.set()
        await first
        gate.clear()
        held = asyncio.create_task(b.submit("k", [1]))  # runs, held by the gate
        while b._pending or not b._running:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(b.submit("k", list(range(10, 20))))
        await asyncio.sleep(0.05)
        with pytest.raises(DeadlineExceeded, match="queued ahead"):
            await b.submit("k", [99], deadline=time.monotonic() + 2.0)
        with pytest.raises(DeadlineExceeded, match="had passed"):
            await b.submit("k", [98], deadline=time.monotonic() - 0.1)
        gate.set()
        out = await asyncio.gather(held, queued)
        await b.close()
        return out

    assert asyncio.run(main()) == [[1], list(range(10, 20))]
    assert [99] not in ran and [98] not in ran


def test_waiting_for_overlapping_callers_still_answers_each_its_own():
    def fn(key, items):
        time.sleep(0.01)
        return [x * 2 for x in items]

    async def main():
        b = MicroBatcher(fn, max_items=8, max_wait_s=0.05)
        out = []
        for _ in range(3):  # rounds of overlapping callers, as a closed loop of clients makes them
            out.append(await asyncio.gather(*[b.submit("k", [i]) for i in range(12)]))
        await b.close()
        return out

    for round_ in asyncio.run(main()):
        assert round_ == [[2 * i] for i in range(12)]
