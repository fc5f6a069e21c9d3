"""prm service process. Until its engine is built it starts, reports itself live
but not ready, and answers every RPC with UNIMPLEMENTED and the reason."""

from __future__ import annotations

from prorag.grpc_server import ServerSpec, start_server, unimplemented_servicer
from prorag.pb import prm_pb2_grpc
from prorag.service import ServeConfig, Started

SERVICE = "prorag.v1.ProcessRewardModel"
REASON = "the process reward model arrives with ProRAG stage 2 (see ROADMAP)"


async def start(serve: ServeConfig, **_: object) -> Started:
    servicer = unimplemented_servicer(prm_pb2_grpc.ProcessRewardModelServicer, SERVICE, REASON)
    spec = ServerSpec(name="prm", services=[(SERVICE, lambda s: prm_pb2_grpc.add_ProcessRewardModelServicer_to_server(servicer, s))],
                      ready={SERVICE: False})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb)
    return Started("prm", running.port, None, [lambda: running.stop(serve.grace_s)])
