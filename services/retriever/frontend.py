"""The request path shared by the gRPC and HTTP front ends: per-request validation,
then one batched engine call for all concurrent callers of the same index."""

from __future__ import annotations

from prorag.rpc.batching import MicroBatcher


class SearchFrontend:
    def __init__(self, engine, max_items: int = 1024, max_queue: int = 4096):
        self.engine = engine
        self.batcher = MicroBatcher(self._run, max_items=max_items, max_queue=max_queue, name="retriever")

    def _run(self, index: str, items: list[tuple[str, int]]) -> list:
        # One engine call at the largest topk of the group; each caller gets its own cut.
        k = max(topk for _, topk in items)
        results = self.engine.search([q for q, _ in items], k, index, enforce_max_batch=False)
        return [docs[:topk] for docs, (_, topk) in zip(results, items)]

    async def search(self, queries: list[str], topk: int, index: str = "", deadline: float | None = None):
        """Validate (raises InvalidArgument / NotFound for the caller), then search batched."""
        name = self.engine.validate(queries, topk, index)
        results = await self.batcher.submit(name, [(q, topk) for q in queries], deadline)
        return name, results

    async def close(self) -> None:
        await self.batcher.close()
