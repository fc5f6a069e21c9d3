"""Judge service process: labels sibling reasoning steps (ProRAG's contrastive pairs)."""

from __future__ import annotations

from dataclasses import dataclass

from prorag import paths
from prorag.config import cfg_field
from prorag.grpc_server import ServerSpec, start_server
from prorag.pb import judge_pb2_grpc
from prorag.service import ServeConfig, Started
from services.judge.servicer import JudgeServicer

SERVICE = "prorag.v1.Judge"


@dataclass
class JudgeConfig:
    """Which judge answers and the limits it enforces on callers."""

    backend: str = cfg_field("reference", help="reference = ProRAG's rules checked against the world's gold "
                                               "decompositions (offline); openai arrives with stage 2",
                             choices=("reference",))
    world: str = cfg_field("default", help="embedded world whose gold decompositions the reference judge reads")
    max_items: int = cfg_field(256, help="most items in one request", min=1, max=100000)
    max_candidates: int = cfg_field(16, help="most sibling candidates in one item", min=2, max=1024)


def open_engine(cfg: JudgeConfig):
    from services.judge.engine import ReferenceJudge

    return ReferenceJudge.from_world(paths.world_dir(cfg.world))


async def start(serve: ServeConfig, cfg: JudgeConfig | None = None, engine=None) -> Started:
    cfg = cfg or JudgeConfig()
    servicer = JudgeServicer(engine or open_engine(cfg), cfg.max_items, cfg.max_candidates)
    spec = ServerSpec(name="judge",
                      services=[(SERVICE, lambda s: judge_pb2_grpc.add_JudgeServicer_to_server(servicer, s))])
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb)
    return Started("judge", running.port, None, [lambda: running.stop(serve.grace_s)])
