"""Real gRPC servers on port 0 on loopback: health, reflection, UNIMPLEMENTED placeholders,
and the error-mapping interceptor."""

import importlib

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prorag.errors import InvalidArgument, NotFound
from prorag.rpc.grpc_server import ServerSpec, start_server
from prorag.pb import retriever_pb2, retriever_pb2_grpc
from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread


@pytest.fixture(scope="module")
def loop():
    lp = LoopThread()
    yield lp
    lp.close()


@pytest.mark.parametrize("service, full", [
    ("prm", "prorag.v1.ProcessRewardModel")])
def test_placeholder_services_are_live_reflective_and_unimplemented(loop, service, full):
    module = importlib.import_module(f"services.{service}.server")
    started = loop.run(module.start(ServeConfig(port=0)))
    try:
        target = f"127.0.0.1:{started.grpc_port}"
        with grpc.insecure_channel(target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service=full), timeout=5).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            db = ProtoReflectionDescriptorDatabase(ch)
            assert full in db.get_services()
            pool = descriptor_pool.DescriptorPool(db)
            svc = pool.FindServiceByName(full)
            assert len(svc.methods) >= 2
    finally:
        loop.run(started.stop())


class _Raising(retriever_pb2_grpc.RetrieverServicer):
    async def Search(self, request, context):
        if request.index == "missing":
            raise NotFound("index 'missing' not found; known: dense")
        if request.topk <= 0:
            raise InvalidArgument("topk must be >= 1")
        raise RuntimeError("a bug")

    async def ListIndexes(self, request, context):
        return retriever_pb2.ListIndexesResponse(max_topk=5)


def test_interceptor_maps_errors_and_server_keeps_serving(loop):
    servicer = _Raising()
    spec = ServerSpec(name="t", services=[("prorag.v1.Retriever",
                                           lambda s: retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, s))])
    running = loop.run(start_server(spec, 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = retriever_pb2_grpc.RetrieverStub(ch)
            cases = [(retriever_pb2.SearchRequest(queries=["q"], topk=0), grpc.StatusCode.INVALID_ARGUMENT, "topk"),
                     (retriever_pb2.SearchRequest(queries=["q"], topk=1, index="missing"), grpc.StatusCode.NOT_FOUND,
                      "known: dense"),
                     (retriever_pb2.SearchRequest(queries=["q"], topk=1), grpc.StatusCode.INTERNAL, "a bug")]
            for req, code, fragment in cases:
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Search(req, timeout=5)
                assert ei.value.code() == code
                assert fragment in ei.value.details()
            assert stub.ListIndexes(retriever_pb2.ListIndexesRequest(), timeout=5).max_topk == 5
    finally:
        loop.run(running.stop())
