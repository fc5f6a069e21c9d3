"""One import point for the generated messages and stubs: ``from prorag.pb import pb2, grpc_``."""

from prorag.rpc.protos import ensure as _ensure

_ensure()

from prorag.v1 import common_pb2, judge_pb2, judge_pb2_grpc, policy_pb2, policy_pb2_grpc  # noqa: E402
from prorag.v1 import prm_pb2, prm_pb2_grpc, retriever_pb2, retriever_pb2_grpc  # noqa: E402
from prorag.v1 import trainer_pb2, trainer_pb2_grpc  # noqa: E402

__all__ = [
    "common_pb2", "retriever_pb2", "retriever_pb2_grpc", "policy_pb2", "policy_pb2_grpc",
    "prm_pb2", "prm_pb2_grpc", "judge_pb2", "judge_pb2_grpc", "trainer_pb2", "trainer_pb2_grpc",
]
