"""Typed clients for the ProRAG services, with deadlines on every call and message limits
matching the servers'. Other systems can use these or the protos directly."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag.pb import retriever_pb2, retriever_pb2_grpc

MiB = 1024 * 1024


def channel(target: str, max_message_mb: int = 64) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", max_message_mb * MiB),
        ("grpc.max_send_message_length", max_message_mb * MiB),
    ])


def wait_for_health(target: str, service: str = "", timeout: float = 60.0) -> bool:
    """Poll grpc.health.v1 until ``service`` is SERVING or ``timeout`` passes; True if serving."""
    deadline = time.monotonic() + timeout
    with channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


@dataclass
class RetrievedDoc:
    id: str
    title: str
    text: str
    contents: str
    score: float
    rank: int


class RetrieverClient:
    def __init__(self, target: str, timeout: float = 30.0, max_message_mb: int = 64):
        self.target = target
        self.timeout = timeout
        self._channel = channel(target, max_message_mb)
        self._stub = retriever_pb2_grpc.RetrieverStub(self._channel)

    def search(self, queries: list[str], topk: int = 3, index: str = "",
               timeout: float | None = None) -> list[list[RetrievedDoc]]:
        resp = self._stub.Search(retriever_pb2.SearchRequest(queries=queries, topk=topk, index=index),
                                 timeout=timeout or self.timeout)
        return [[RetrievedDoc(d.document.id, d.document.title, d.document.text, d.document.contents, d.score, d.rank)
                 for d in r.documents] for r in resp.results]

    def get_documents(self, ids: list[str], timeout: float | None = None) -> list[RetrievedDoc]:
        resp = self._stub.GetDocuments(retriever_pb2.GetDocumentsRequest(ids=ids), timeout=timeout or self.timeout)
        return [RetrievedDoc(d.id, d.title, d.text, d.contents, 0.0, 0) for d in resp.documents]

    def list_indexes(self, timeout: float | None = None) -> retriever_pb2.ListIndexesResponse:
        return self._stub.ListIndexes(retriever_pb2.ListIndexesRequest(), timeout=timeout or self.timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
