"""All five services started for real on loopback with TLS and bearer tokens on (what a secured deployment
runs): every RPC of every service refuses a call without a token (UNAUTHENTICATED) and an administrative
RPC refuses a token without the admin scope (PERMISSION_DENIED), before any servicer runs; the HTTP
endpoints answer 401; with the right token the same calls work; health stays open for probes; a
plaintext client cannot talk to a TLS server; with mutual TLS a client without a certificate is refused."""

from __future__ import annotations

import ssl

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag.rpc.clients import PolicyClient, RetrieverClient
from prorag.rpc.clients_trainer import TrainerClient
from prorag.pb import trainer_pb2
from prorag.rpc.security import ClientSecurity, generate_secrets, secure_channel
from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread
from tests.services.five_services import DESCRIPTORS, build_stack_files
from tests.services.http_json import post_json

ADMIN = {"/prorag.v1.Policy/LoadAdapter", "/prorag.v1.Policy/ActivateAdapter", "/prorag.v1.Policy/UnloadAdapter"}




@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("secrets")
    return out, generate_secrets(out)


@pytest.fixture(scope="module")
def services(tiny_policy, secrets_dir, tmp_path_factory):
    """name -> (grpc port, http port or None), every server with TLS and tokens from ServeConfig fields."""
    from services.judge.engine import ReferenceJudge
    from services.judge.server import JudgeConfig
    from services.judge.server import start as start_judge
    from services.policy.server import PolicyConfig
    from services.policy.server import start as start_policy
    from services.prm.engine import PRMEngine
    from services.prm.server import PRMServeConfig
    from services.prm.server import start as start_prm
    from services.retriever.engine import RetrievalEngine
    from services.retriever.server import RetrieverConfig
    from services.retriever.server import start as start_retriever
    from services.trainer.server import TrainerConfig
    from services.trainer.server import start as start_trainer
    from tests.search.test_judging import Q

    _, files = secrets_dir
    tmp = tmp_path_factory.mktemp("auth-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("PRORAG_DATA", str(tmp / "data"))
    model_dir, _ = tiny_policy
    build_stack_files(tmp, model_dir)

    def serve(http: bool) -> ServeConfig:
        return ServeConfig(port=0, http_port=0 if http else -1, grace_s=1, tls_cert=files["server_cert"],
                           tls_key=files["server_key"], auth_tokens=files["tokens"])

    loop = LoopThread()
    started = {
        "retriever": loop.run(start_retriever(serve(True), RetrieverConfig(), engine=RetrievalEngine.from_dir(
            tmp / "index", default="bm25"))),
        "prm": loop.run(start_prm(serve(False), PRMServeConfig(), engine=PRMEngine(str(tmp / "prm"), max_len=0))),
        "judge": loop.run(start_judge(serve(False), JudgeConfig(), engine=ReferenceJudge([Q]))),
        "trainer": loop.run(start_trainer(serve(False), TrainerConfig(jobs_root=str(tmp / "jobs"),
                                                                         tracking="local"))),
    }
    # The policy's own calls to the retriever go through the same TLS and token settings (from the env).
    mp.setenv("PRORAG_TLS_CA", files["ca"])
    mp.setenv("PRORAG_TOKEN_FILE", files["token_client"])
    started["policy"] = loop.run(start_policy(serve(True), PolicyConfig(
        model=str(model_dir), retriever=f"localhost:{started['retriever'].grpc_port}")))
    mp.delenv("PRORAG_TLS_CA")
    mp.delenv("PRORAG_TOKEN_FILE")
    yield {name: (s.grpc_port, s.http_port) for name, s in started.items()}
    for s in started.values():
        loop.run(s.stop())
    loop.close()
    mp.undo()


def _security(files, token_key: str | None, ca: bool = True, client_cert: bool = False) -> ClientSecurity:
    token = open(files[token_key]).read().strip() if token_key else ""
    return ClientSecurity(token=token, tls_ca=files["ca"] if ca else "", tls_server_name="localhost",
                          tls_client_cert=files["client_cert"] if client_cert else "",
                          tls_client_key=files["client_key"] if client_cert else "")


def _call_every_method(port: int, service_desc, security: ClientSecurity) -> dict[str, grpc.StatusCode]:
    """Each RPC of the service called with an empty request -> the status code it answered."""
    codes = {}
    with secure_channel(f"localhost:{port}", security=security) as ch:
        for m in service_desc.methods:
            name = f"/{service_desc.full_name}/{m.name}"
            request_cls = message_factory.GetMessageClass(m.input_type)
            response_cls = message_factory.GetMessageClass(m.output_type)
            kw = dict(request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)
            try:
                if m.server_streaming:
                    list(ch.unary_stream(name, **kw)(request_cls(), timeout=10))
                else:
                    ch.unary_unary(name, **kw)(request_cls(), timeout=10)
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                codes[name] = e.code()
    return codes


def test_every_rpc_of_every_service_refuses_a_call_without_a_token(services, secrets_dir):
    _, files = secrets_dir
    for name, (port, _) in services.items():
        codes = _call_every_method(port, DESCRIPTORS[name], _security(files, None))
        assert codes and set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (name, codes)


def test_a_wrong_token_is_refused_like_none(services, secrets_dir):
    _, files = secrets_dir
    bad = ClientSecurity(token="x" * 43, tls_ca=files["ca"], tls_server_name="localhost")
    for name, (port, _) in services.items():
        codes = _call_every_method(port, DESCRIPTORS[name], bad)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (name, codes)


def test_administrative_rpcs_need_the_admin_scope(services, secrets_dir):
    _, files = secrets_dir
    client = _security(files, "token_client")
    for name in ("policy", "trainer"):
        codes = _call_every_method(services[name][0], DESCRIPTORS[name], client)
        for method, code in codes.items():
            if name == "trainer" or method in ADMIN:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code)
            else:  # past auth: the servicer answered (an empty request is a caller's mistake, or fine)
                assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, code)
    admin = _security(files, "token_admin")
    with TrainerClient(f"localhost:{services['trainer'][0]}") as tc:
        tc._channel.close()
        tc._channel = secure_channel(f"localhost:{services['trainer'][0]}", security=admin)
        from prorag.pb import trainer_pb2_grpc

        tc._stub = trainer_pb2_grpc.TrainerStub(tc._channel)
        job = tc.start("selftest", {"steps": 3}, job_id="auth-ok")
        assert tc.wait(job.job_id, timeout=60).state == trainer_pb2.JOB_STATE_SUCCEEDED


def test_with_the_token_the_services_work_and_the_policy_reaches_the_secured_retriever(services, secrets_dir,
                                                                                        monkeypatch):
    _, files = secrets_dir
    monkeypatch.setenv("PRORAG_TLS_CA", files["ca"])
    monkeypatch.setenv("PRORAG_TLS_SERVER_NAME", "localhost")
    monkeypatch.setenv("PRORAG_TOKEN_FILE", files["token_client"])
    with RetrieverClient(f"localhost:{services['retriever'][0]}") as rc:
        hits = rc.search(["Who founded Mai Brewery?"], topk=1)
    assert hits[0][0].id == "d1"
    with PolicyClient(f"localhost:{services['policy'][0]}") as pc:
        # Naming the index makes the policy ask the retriever (over TLS, with its token) before rolling out.
        events = list(pc.rollout([("q1", "Who founded Mai Brewery?")], pc.sampling(max_tokens=8), max_steps=2,
                                 retriever_index="bm25"))
        with pytest.raises(grpc.RpcError) as e:
            list(pc.rollout([("q1", "Who founded Mai Brewery?")], max_steps=2, retriever_index="nope"))
    assert [type(ev).__name__ for ev in events] == ["Trajectory", "RolloutSummary"]
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "bm25" in e.value.details()


def test_health_is_open_for_probes(services, secrets_dir):
    _, files = secrets_dir
    for name, (port, _) in services.items():
        with secure_channel(f"localhost:{port}", security=_security(files, None)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_a_plaintext_client_cannot_talk_to_a_tls_server(services, secrets_dir):
    _, files = secrets_dir
    token = open(files["token_client"]).read().strip()
    with secure_channel(f"127.0.0.1:{services['retriever'][0]}", security=ClientSecurity(token=token)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def _post(url: str, body: dict, token: str | None, ctx: ssl.SSLContext) -> tuple[int, dict]:
    return post_json(url, body, token=token, context=ctx)


def test_http_endpoints_answer_401_without_a_token_and_work_with_one(services, secrets_dir):
    _, files = secrets_dir
    ctx = _security(files, None).ssl_context()
    ctx.check_hostname = True
    token = open(files["token_client"]).read().strip()
    retrieve = f"https://localhost:{services['retriever'][1]}/retrieve"
    completions = f"https://localhost:{services['policy'][1]}/v1/completions"
    for url, body in ((retrieve, {"queries": ["Mai Brewery"], "topk": 1}),
                      (completions, {"model": "x", "prompt": "Hello", "max_tokens": 2})):
        status, payload = _post(url, body, None, ctx)
        assert status == 401 and "bearer token" in payload["error"], (url, status, payload)
        status, payload = _post(url, body, "y" * 40, ctx)
        assert status == 401, (url, status)
    status, payload = _post(retrieve, {"queries": ["Mai Brewery"], "topk": 1}, token, ctx)
    assert status == 200 and payload["result"][0][0]["document"]["id"] == "d1"


def test_mutual_tls_refuses_a_client_without_a_certificate(tiny_policy, secrets_dir):
    from services.judge.engine import ReferenceJudge
    from services.judge.server import JudgeConfig, start
    from tests.search.test_judging import Q

    _, files = secrets_dir
    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0, tls_cert=files["server_cert"], tls_key=files["server_key"],
                                         tls_client_ca=files["ca"]), JudgeConfig(), engine=ReferenceJudge([Q])))
    try:
        target = f"localhost:{started.grpc_port}"
        with secure_channel(target, security=_security(files, None)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with secure_channel(target, security=_security(files, None, client_cert=True)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        loop.run(started.stop())
        loop.close()
