"""Merges concurrent generate calls (GenerateSteps requests and every rollout's rounds) into
one engine batch per (adapter, sampling) group: the engine is fastest on large batches."""

from __future__ import annotations

import asyncio
from typing import Sequence

from prometheus_client import Counter

from prorag.rpc.batching import MicroBatcher
from prorag.errors import FailedPrecondition
from prorag.engine import GeneratedSeq, GenerationEngine, SamplingSpec, derive_seed


GENERATED_TOKENS = Counter("prorag_policy_generated_tokens_total", "Tokens the policy's engine generated (steps, "
                           "rollouts and HTTP completions)")


class GenerationScheduler:
    def __init__(self, engine: GenerationEngine, max_items: int = 1024, max_queue: int = 4096):
        self.engine = engine
        self.batcher = MicroBatcher(self._run, max_items=max_items, max_queue=max_queue, name="policy",
                                    concurrency=max(1, int(getattr(engine, "concurrent_calls", 1))))
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self, key, items: list) -> list:
        adapter, n, temperature, top_p, max_tokens, stops, tempered = key
        spec = SamplingSpec(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop_token_ids=stops,
                            tempered_logprobs=tempered)
        out = self.engine.generate([p for p, _ in items], spec, adapter, seeds=[s for _, s in items])
        GENERATED_TOKENS.inc(sum(len(seq.token_ids) for seqs in out for seq in seqs))
        return out

    async def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, adapter: str | None,
                       seeds: Sequence[int], deadline: float | None = None) -> list[list[GeneratedSeq]]:
        key = (adapter, spec.n, spec.temperature, spec.top_p, spec.max_tokens, tuple(spec.stop_token_ids),
               spec.tempered_logprobs)
        return await self.batcher.submit(key, list(zip([list(p) for p in prompts], seeds)), deadline)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def sync_engine(self, deadline: float | None = None) -> "_ThreadEngine":
        """An engine facade for code running in worker threads (rollouts): calls go through the batcher."""
        return _ThreadEngine(self, deadline)

    async def close(self) -> None:
        await self.batcher.close()


class _ThreadEngine(GenerationEngine):
    name = "scheduled"

    def __init__(self, scheduler: GenerationScheduler, deadline: float | None):
        self._s = scheduler
        self._deadline = deadline
        self.tokenizer = scheduler.engine.tokenizer
        self.max_model_len = scheduler.engine.max_model_len

    def generate(self, prompts, params, adapter=None, seeds=None):
        if seeds is None:
            seeds = [derive_seed(params.seed, i) for i in range(len(prompts))]
        fut = asyncio.run_coroutine_threadsafe(
            self._s.generate(prompts, params, adapter, seeds, self._deadline), self._s.loop)
        return fut.result()

    def load_adapter(self, key, path):
        raise FailedPrecondition("adapters are managed by the policy service")

    def unload_adapter(self, key):
        raise FailedPrecondition("adapters are managed by the policy service")

    def adapters(self):
        return self._s.engine.adapters()

    def info(self):
        return self._s.engine.info()
