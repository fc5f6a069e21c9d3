"""policy service process. Until its engine is built it starts, reports itself live
but not ready, and answers every RPC with UNIMPLEMENTED and the reason."""

from __future__ import annotations

from prorag.grpc_server import ServerSpec, start_server, unimplemented_servicer
from prorag.pb import policy_pb2_grpc
from prorag.service import ServeConfig, Started

SERVICE = "prorag.v1.Policy"
REASON = "step generation, rollouts and LoRA hot reload arrive with the policy issue"


async def start(serve: ServeConfig, **_: object) -> Started:
    servicer = unimplemented_servicer(policy_pb2_grpc.PolicyServicer, SERVICE, REASON)
    spec = ServerSpec(name="policy", services=[(SERVICE, lambda s: policy_pb2_grpc.add_PolicyServicer_to_server(servicer, s))],
                      ready={SERVICE: False})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb)
    return Started("policy", running.port, None, [lambda: running.stop(serve.grace_s)])
