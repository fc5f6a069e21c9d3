"""trainer service process. Until its engine is built it starts, reports itself live
but not ready, and answers every RPC with UNIMPLEMENTED and the reason."""

from __future__ import annotations

from prorag.grpc_server import ServerSpec, start_server, unimplemented_servicer
from prorag.pb import trainer_pb2_grpc
from prorag.service import ServeConfig, Started

SERVICE = "prorag.v1.Trainer"
REASON = "training jobs arrive with the trainer/SFT issue"


async def start(serve: ServeConfig, **_: object) -> Started:
    servicer = unimplemented_servicer(trainer_pb2_grpc.TrainerServicer, SERVICE, REASON)
    spec = ServerSpec(name="trainer", services=[(SERVICE, lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s))],
                      ready={SERVICE: False})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb)
    return Started("trainer", running.port, None, [lambda: running.stop(serve.grace_s)])
