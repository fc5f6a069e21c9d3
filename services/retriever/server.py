"""Retriever service process: gRPC prorag.v1.Retriever + Search-R1-compatible HTTP /retrieve,
both in front of one batched engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.config import cfg_field
from prorag.pb import retriever_pb2_grpc
from prorag.rpc.grpc_server import ServerSpec
from prorag.rpc.service import ServeConfig, Started, start_grpc_and_http
from services.retriever.engine import RetrievalEngine
from services.retriever.frontend import SearchFrontend
from services.retriever.http import make_app
from services.retriever.servicer import RetrieverServicer

SERVICE = "prorag.v1.Retriever"


@dataclass
class RetrieverConfig:
    """What the retriever serves and the limits it enforces on callers."""

    index_root: str = cfg_field("", help="directory holding dense*/, bm25/ and docstore/ (empty = the embedded "
                                         "world's)")
    world: str = cfg_field("default", help="embedded world whose indexes are served when index_root is empty")
    default_index: str = cfg_field("hybrid", help="index used when a request names none")
    default_topk: int = cfg_field(3, help="HTTP topk when the request omits it (Search-R1 behaviour)", min=1)
    max_topk: int = cfg_field(100, help="largest topk a caller may ask for", min=1, max=10000)
    max_batch: int = cfg_field(512, help="most queries in one request", min=1, max=100000)
    max_query_chars: int = cfg_field(4096, help="longest query accepted, in characters", min=1)
    max_batch_items: int = cfg_field(1024, help="most queries merged into one engine call across callers", min=1)
    max_queue: int = cfg_field(4096, help="most requests waiting; beyond it callers get RESOURCE_EXHAUSTED", min=1)

    def resolved_index_root(self) -> Path:
        return Path(self.index_root) if self.index_root else paths.index_dir(self.world)


def open_engine(cfg: RetrieverConfig):
    return RetrievalEngine.from_dir(cfg.resolved_index_root(), default=cfg.default_index)


async def start(serve: ServeConfig, cfg: RetrieverConfig | None = None, engine=None) -> Started:
    cfg = cfg or RetrieverConfig()
    engine = engine or open_engine(cfg)
    frontend = SearchFrontend(engine, max_topk=cfg.max_topk, max_batch=cfg.max_batch,
                              max_query_chars=cfg.max_query_chars, max_items=cfg.max_batch_items,
                              max_queue=cfg.max_queue)
    servicer = RetrieverServicer(frontend)
    spec = ServerSpec(name="retriever",
                      services=[(SERVICE, lambda s: retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, s))])
    _, started = await start_grpc_and_http(serve, spec, lambda: make_app(frontend, cfg.default_topk))
    started.stoppers.append(frontend.close)
    return started
