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
