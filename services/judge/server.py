"""judge service process. Until its engine is built it starts, reports itself live
but not ready, and answers every RPC with UNIMPLEMENTED and the reason."""

from __future__ import annotations

from prorag.grpc_server import ServerSpec, start_server, unimplemented_servicer
from prorag.pb import judge_pb2_grpc
from prorag.service import ServeConfig, Started

SERVICE = "prorag.v1.Judge"
REASON = "pair judging arrives with ProRAG stage 2 (see ROADMAP)"


async def start(serve: ServeConfig, **_: object) -> Started:
    servicer = unimplemented_servicer(judge_pb2_grpc.JudgeServicer, SERVICE, REASON)
    spec = ServerSpec(name="judge", services=[(SERVICE, lambda s: judge_pb2_grpc.add_JudgeServicer_to_server(servicer, s))],
                      ready={SERVICE: False})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb)
    return Started("judge", running.port, None, [lambda: running.stop(serve.grace_s)])
