"""The policy's client of the retriever service: the search its rollouts make, with the retriever's errors turned
into the policy's."""

from __future__ import annotations

import time

import grpc

from prorag.data.loaders import Document
from prorag.errors import InvalidArgument, NotFound, Unavailable
from prorag.rpc.clients import RetrieverClient


class RetrieverSearch:
    """Rollouts' search over the live retriever service (``target``), with its errors turned into ours."""

    def __init__(self, target: str, timeout: float):
        self.target, self.timeout = target, timeout
        self.client = RetrieverClient(target, timeout=timeout)
        self._known: dict[str, float] = {}  # index -> when the retriever last listed it

    def check_index(self, index: str) -> None:
        """Refuse an unknown retriever index before any rollout starts (cached for a minute)."""
        if not index or time.monotonic() - self._known.get(index, -1e9) < 60:
            return
        try:
            names = [i.name for i in self.client.list_indexes(timeout=min(self.timeout, 10)).indexes]
        except grpc.RpcError as e:
            raise Unavailable(f"retriever at {self.target} failed ({e.code().name}): {e.details()}") from None
        if index not in names:
            raise NotFound(f"retriever index {index!r} not found; the retriever at {self.target} serves {names}")
        self._known[index] = time.monotonic()

    def search_fn(self, index: str, deadline: float | None):
        """The ``search_fn`` of one rollout: ``index`` searched, each call within the rollout's deadline."""
        def search(queries: list[str], topk: int) -> list[list[Document]]:
            remaining = self.timeout if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                return self.client.search(queries, topk=topk, index=index, timeout=min(self.timeout, remaining))
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    err = InvalidArgument if code == grpc.StatusCode.INVALID_ARGUMENT else NotFound
                    raise err(f"retriever: {e.details()}") from None
                raise Unavailable(f"retriever at {self.target} failed ({code.name}): {e.details()}") from None

        return search
