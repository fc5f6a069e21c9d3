"""The request path shared by the gRPC and HTTP front ends: every check of a request and the limits it is held
to, then one batched engine call for all concurrent callers of the same index. The transports only convert
their wire types; the engine trusts what reaches it."""

from __future__ import annotations

from prorag.data.loaders import Document
from prorag.errors import InvalidArgument, NotFound
from prorag.rpc.batching import MicroBatcher
from services.retriever.engine import RetrievalEngine


class SearchFrontend:
    def __init__(self, engine: RetrievalEngine, *, max_topk: int = 100, max_batch: int = 512,
                 max_query_chars: int = 4096, max_items: int = 1024, max_queue: int = 4096):
        self.engine = engine
        self.max_topk, self.max_batch, self.max_query_chars = max_topk, max_batch, max_query_chars
        self.batcher = MicroBatcher(self._run, max_items=max_items, max_queue=max_queue, name="retriever")

    def _run(self, index: str, items: list[tuple[str, int]]) -> list:
        # One engine call at the largest topk of the group; each caller gets its own cut. The merged call
        # may exceed max_batch: that limits a caller's request, not the batch.
        k = max(topk for _, topk in items)
        results = self.engine.search([q for q, _ in items], k, index)
        return [docs[:topk] for docs, (_, topk) in zip(results, items)]

    def index_name(self, requested: str = "") -> str:
        """The index that answers a request naming ``requested`` ('' = the default); NotFound names the known ones."""
        name = requested or self.engine.default
        if name not in self.engine.indexes:
            raise NotFound(f"unknown index {name!r}; known indexes: {', '.join(sorted(self.engine.indexes))}")
        return name

    def check_search(self, queries: list[str], topk: int, index: str = "") -> str:
        """Raise InvalidArgument / NotFound for a bad request; return the index name that will answer."""
        name = self.index_name(index)
        if not queries:
            raise InvalidArgument("no queries given; send 1 to max_batch queries")
        if len(queries) > self.max_batch:
            raise InvalidArgument(f"{len(queries)} queries in one call; the limit is {self.max_batch} (max_batch): "
                                  "split the batch")
        for i, q in enumerate(queries):
            if not q.strip():
                raise InvalidArgument(f"queries[{i}] is blank; every query needs text")
            if len(q) > self.max_query_chars:
                raise InvalidArgument(f"queries[{i}] has {len(q)} characters; the limit is {self.max_query_chars} "
                                      "(max_query_chars): shorten it")
        if not 1 <= topk <= self.max_topk:
            raise InvalidArgument(f"topk must be an integer from 1 to {self.max_topk} (max_topk), got {topk!r}")
        return name

    async def search(self, queries: list[str], topk: int, index: str = "",
                     deadline: float | None = None) -> tuple[str, list[list[Document]]]:
        """(the index that answered, per query its top ``topk`` documents), batched with concurrent callers."""
        name = self.check_search(queries, topk, index)
        results = await self.batcher.submit(name, [(q, topk) for q in queries], deadline)
        return name, results

    def get_documents(self, ids: list[str]) -> list[Document]:
        if len(ids) > self.max_batch:
            raise InvalidArgument(f"{len(ids)} ids in one call; the limit is {self.max_batch} (max_batch)")
        return self.engine.get_documents(ids)

    def list_indexes(self) -> list[dict]:
        return self.engine.list_indexes()

    async def close(self) -> None:
        await self.batcher.close()
