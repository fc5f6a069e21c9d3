"""The retriever service over real gRPC and HTTP on loopback (port 0), on the tiny embedded world."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prorag.rpc.clients import RetrieverClient
from prorag.pb import retriever_pb2, retriever_pb2_grpc
from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread, env, tiny_data
from tests.services.http_json import post_json


@pytest.fixture(scope="module")
def world_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    tiny_data(home / "data")
    with env("PRORAG_DATA", str(home / "data")):
        from prorag_app.embedded import ensure_indexes

        ensure_indexes("tiny")
        yield home


@pytest.fixture(scope="module")
def server(world_home):
    from services.retriever.server import RetrieverConfig, start

    loop = LoopThread()
    cfg = RetrieverConfig(world="tiny", max_topk=20, max_batch=32, max_query_chars=200)
    started = loop.run(start(ServeConfig(port=0, http_port=0), cfg))
    yield started
    loop.run(started.stop())
    loop.close()


@pytest.fixture(scope="module")
def test_questions(world_home):
    from prorag import paths
    from prorag.data.loaders import load_split

    return load_split(paths.world_dir("tiny"), "test")


def _post(port: int, body, raw: bytes | None = None):
    return post_json(f"http://127.0.0.1:{port}/retrieve", body, raw=raw)


def test_reflection_and_health(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        assert "prorag.v1.Retriever" in ProtoReflectionDescriptorDatabase(ch).get_services()
        health = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "prorag.v1.Retriever"):
            assert health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_grpc_search_finds_gold_documents(server, test_questions):
    subs = [s for q in test_questions for s in q.decomposition if s.doc_id][:32]
    with RetrieverClient(f"127.0.0.1:{server.grpc_port}") as client:
        info = client.list_indexes()
        assert {i.name for i in info.indexes} >= {"dense", "bm25", "hybrid"}
        assert info.max_topk == 20
        for index in ("dense", "bm25", "hybrid"):
            results = client.search([s.question for s in subs], topk=5, index=index)
            assert len(results) == len(subs)
            hits = sum(s.doc_id in [d.id for d in docs] for s, docs in zip(subs, results))
            assert hits / len(subs) >= 0.6, (index, hits)
            for docs in results:
                scores = [d.score for d in docs]
                assert scores == sorted(scores, reverse=True)
                assert all(d.contents.startswith(f'"{d.title}"\n') for d in docs)


def test_http_is_search_r1_compatible(server, test_questions):
    """The request/response shape Search-R1's rollout code sends and reads."""
    queries = [test_questions[0].question, test_questions[1].question]
    for return_scores in (True, False):
        status, body = _post(server.http_port, {"queries": queries, "topk": 3, "return_scores": return_scores})
        assert status == 200
        assert len(body["result"]) == 2
        for docs in body["result"]:
            assert len(docs) == 3
            for item in docs:
                # Search-R1's _passages2string: title = contents.split("\n")[0], text = the rest
                content = item["document"]["contents"]
                title, text = content.split("\n")[0], "\n".join(content.split("\n")[1:])
                assert title.startswith('"') and text
                assert isinstance(item["score"], float)
                assert set(item["document"]) == {"id", "contents"}
    status, body = _post(server.http_port, {"queries": queries})  # topk omitted -> the default 3
    assert status == 200 and all(len(d) == 3 for d in body["result"])


@pytest.mark.parametrize("request_kwargs, code, fragment", [
    (dict(queries=[], topk=3), grpc.StatusCode.INVALID_ARGUMENT, "queries"),
    (dict(queries=["ok", "   "], topk=3), grpc.StatusCode.INVALID_ARGUMENT, "1"),
    (dict(queries=["x" * 201], topk=3), grpc.StatusCode.INVALID_ARGUMENT, "200"),
    (dict(queries=["q"] * 33, topk=3), grpc.StatusCode.INVALID_ARGUMENT, "32"),
    (dict(queries=["q"], topk=0), grpc.StatusCode.INVALID_ARGUMENT, "topk"),
    (dict(queries=["q"], topk=-2), grpc.StatusCode.INVALID_ARGUMENT, "topk"),
    (dict(queries=["q"], topk=21), grpc.StatusCode.INVALID_ARGUMENT, "20"),
    (dict(queries=["q"], topk=3, index="nope"), grpc.StatusCode.NOT_FOUND, "hybrid"),
])
def test_grpc_bad_input_gets_clear_status_and_server_keeps_serving(server, request_kwargs, code, fragment):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        stub = retriever_pb2_grpc.RetrieverStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Search(retriever_pb2.SearchRequest(**request_kwargs), timeout=30)
        assert ei.value.code() == code
        assert fragment in ei.value.details()
        ok = stub.Search(retriever_pb2.SearchRequest(queries=["capital city"], topk=2), timeout=30)
        assert len(ok.results[0].documents) == 2


def test_grpc_oversized_message_is_refused(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        stub = retriever_pb2_grpc.RetrieverStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Search(retriever_pb2.SearchRequest(queries=["x" * (65 * 1024 * 1024)], topk=1), timeout=60)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_get_documents(server, test_questions):
    doc_id = test_questions[0].decomposition[0].doc_id
    with RetrieverClient(f"127.0.0.1:{server.grpc_port}") as client:
        (doc,) = client.get_documents([doc_id])
        assert doc.id == doc_id and doc.title == test_questions[0].decomposition[0].title
        with pytest.raises(grpc.RpcError) as ei:
            client.get_documents(["no-such-doc"])
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("body, raw, status, fragment", [
    (None, b"{not json", 400, "JSON"),
    ([1, 2], None, 400, "object"),
    ({"queries": "one string"}, None, 400, "list of strings"),
    ({"queries": ["q"], "topk": "3"}, None, 400, "integer"),
    ({"queries": ["q"], "topk": 0}, None, 400, "topk"),
    ({"queries": []}, None, 400, "queries"),
    ({"queries": ["q"], "index": "nope"}, None, 404, "nope"),
    ({"queries": ["q"], "bogus": 1}, None, 400, "bogus"),
])
def test_http_bad_input(server, body, raw, status, fragment):
    got, payload = _post(server.http_port, body, raw)
    assert got == status
    assert fragment in payload["error"]
    ok, payload = _post(server.http_port, {"queries": ["capital"], "topk": 1})
    assert ok == 200 and len(payload["result"][0]) == 1


def test_concurrent_callers_are_batched(server, test_questions):

    queries = [q.question for q in test_questions]
    results, errors = {}, []

    def call(i):
        try:
            with RetrieverClient(f"127.0.0.1:{server.grpc_port}") as c:
                results[i] = c.search(queries[i * 2:i * 2 + 2], topk=3)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with RetrieverClient(f"127.0.0.1:{server.grpc_port}") as c:
        for i in range(16):  # each caller got its own queries' results, not a neighbour's
            assert [d.id for d in results[i][0]] == [d.id for d in c.search([queries[i * 2]], topk=3)[0]]


def test_service_answers_equal_the_in_process_engine(server, test_questions):
    """gRPC and HTTP, one query or many, alone or merged with concurrent callers: the same documents and
    scores as the engine called directly."""
    from prorag_app.bench.retriever import GrpcCaller, HttpCaller, run_shape, shape_plan
    from services.retriever.server import RetrieverConfig, open_engine

    engine = open_engine(RetrieverConfig(world="tiny"))
    queries = [q.question for q in test_questions][:24]
    want = engine.search(queries, 3, "dense")
    with RetrieverClient(f"127.0.0.1:{server.grpc_port}") as c:
        one_by_one = [c.search([q], topk=3, index="dense")[0] for q in queries]
        batch = c.search(queries, topk=3, index="dense")
    for got in (one_by_one, batch):
        assert [[d.id for d in r] for r in got] == [[d.id for d in r] for r in want]
        assert all(abs(a.score - b.score) < 1e-4 for r, w in zip(got, want) for a, b in zip(r, w))
    status, payload = _post(server.http_port, {"queries": queries, "topk": 3, "index": "dense"})
    assert status == 200
    assert [[d["document"]["id"] for d in r] for r in payload["result"]] == [[d.id for d in r] for r in want]
    # the benchmark's load shapes run against this server without errors (16 concurrent one-query callers)
    plan = shape_plan(queries, 16, 1, 3)
    grpc_res = run_shape(lambda: GrpcCaller(f"127.0.0.1:{server.grpc_port}", 3, "dense"), plan, warmup=1)
    http_res = run_shape(lambda: HttpCaller(f"http://127.0.0.1:{server.http_port}/retrieve", 3), plan, warmup=1)
    for res in (grpc_res, http_res):
        assert res["errors"] == 0 and res["qps"] > 0 and res["p50_ms"] <= res["p95_ms"]
    engine.close()
