"""Hostile input, generated (issue 31 item 5): every RPC of the five services and both HTTP APIs get messages built
by hypothesis (tests/services/hostile.py: any message filled from its descriptor; JSON bodies with wrong types,
malformed JSON, deep nesting, enormous numbers), with auth off and on (TLS and bearer tokens, as a secured
deployment runs). Every answer is a documented status: a success, or a status a caller can act on with a message
that says what to do; never UNKNOWN or INTERNAL (HTTP 500). After each RPC's run the service is still healthy: the
health check answers SERVING and a valid request is still answered.

The five services run in this process once per module and auth mode, on port 0, with the smallest real backends the
service tests use (BM25 over a three-document corpus, the tiny policy and its PRM, the reference judge over one
question, the trainer with a temporary jobs root), and small per-request limits so that generated lists and strings
cross them. Examples are derandomised (the same ones on every run, for CI) and sized for a few minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import ssl

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorag.pb import common_pb2, judge_pb2, policy_pb2, prm_pb2, retriever_pb2, trainer_pb2
from prorag.rpc.security import ClientSecurity, generate_secrets, secure_channel
from prorag.rpc.service import ServeConfig
from prorag.trajectory import STOP_TAGS
from tests.helpers import LoopThread
from tests.services.five_services import DESCRIPTORS, build_stack_files
from tests.services import hostile

METHODS = [(name, m.name) for name, desc in DESCRIPTORS.items() for m in desc.methods]

#: what a caller may be answered: a success or a status it can act on (ALREADY_EXISTS: a trainer job id reused with
#: another config; PERMISSION_DENIED: a token without the scope)
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
              grpc.StatusCode.ALREADY_EXISTS}
HTTP_DOCUMENTED = {200, 400, 401, 403, 404, 409, 413, 429, 503, 504}

#: examples per RPC (the slow ones, which generate or score, fewer); the rest get DEFAULT_EXAMPLES
EXAMPLES = {"GenerateSteps": 40, "Rollout": 25, "ScoreSteps": 40, "StartJob": 50, "WatchJob": 20}
DEFAULT_EXAMPLES = 40
HTTP_EXAMPLES = 60
TIMEOUT_S = {"WatchJob": 2.0}  # a watch of a running job streams until its deadline (allowed)

QUESTION = "In which country was the founder of Mai Brewery born?"
SUBQUERY = "I need the founder first.</step>\n<subquery>\nWho founded Mai Brewery?</subquery>"
SUBANSWER = "The document names him.</step>\n<subanswer>\nTova Lunn</subanswer>"
ANSWER = "So the answer is known.</step>\n<answer>\nEdraand</answer>"
INDEXES = st.sampled_from(["", "bm25", "dense", "hybrid", "nope", "BM25", " bm25"])
BLOCKER = "hostile-blocker"  # a long job holding the trainer's one slot: fuzzed jobs stay queued, then cancelled
CANCELLED = "hostile-cancelled"  # a job cancelled while queued


def _stage_fields() -> list[str]:
    from services.trainer.stages import get_stage, known_stages, load_stage_modules

    load_stage_modules()
    return sorted({f.name for s in known_stages() for f in dataclasses.fields(get_stage(s).config_cls)})


def _config_json() -> st.SearchStrategy[str]:
    fields = {name: hostile.json_values() for name in _stage_fields()}
    return st.one_of(hostile.json_object(fields).map(json.dumps), hostile.json_values().map(json.dumps),
                     st.sampled_from([b.decode("utf-8", "replace") for b in hostile.MALFORMED_BODIES]))


def _hints() -> dict:
    """Plausible values by field name, tried alongside the generic ones."""
    from services.trainer.stages import known_stages

    texts = st.sampled_from(["Who founded Mai Brewery?", QUESTION, SUBQUERY, SUBANSWER, ANSWER, "Mai Brewery"])
    return {
        # retriever
        "queries": st.sampled_from(["Mai Brewery", "Who founded Mai Brewery?", "Harlow", "river Stort"]),
        "topk": st.integers(0, 12), "index": INDEXES, "retriever_index": INDEXES,
        "ids": st.sampled_from(["d1", "d2", "d3", "nope", ""]),
        # policy
        "text": texts, "question": texts, "thought": texts, "content": texts,
        "token_ids": st.integers(0, 40), "n": st.integers(0, 5), "max_tokens": st.integers(0, 20),
        "temperature": st.sampled_from([0.0, 0.7, 1.0]), "top_p": st.sampled_from([0.0, 0.9, 1.0]),
        "stop": st.sampled_from(list(STOP_TAGS) + ["</step>", "stop"]), "max_steps": st.integers(0, 5),
        "adapter": st.sampled_from(["", "pol@v1", "pol", "a@b@c", "@", "../x@v1"]),
        "name": st.sampled_from(["", "pol", "..", "a/b", "pol@v1"]),
        "version": st.sampled_from(["", "v1", "..", "v/1"]),
        "path": st.sampled_from(["", "pol/v1", "../../x", "/etc", "."]),
        # judge and PRM
        "question_id": st.sampled_from(["", "q1", "nope"]), "golden_answers": st.sampled_from(["Edraand", ""]),
        "kind": st.sampled_from([common_pb2.STEP_KIND_UNSPECIFIED, common_pb2.STEP_KIND_SUBQUERY]),
        # trainer
        "stage": st.sampled_from(known_stages() + ["", "nope", "SFT", " sft", "selftest "]),
        "config_json": _config_json(),
        "job_id": st.sampled_from(["", "nope", BLOCKER, CANCELLED, "hostile-a", "../x", "a" * 200, "-x"]),
        "after_seq": st.integers(-1, 3),
    }


def _strategy(service: str, method: str):
    m = DESCRIPTORS[service].methods_by_name[method]
    hints = _hints()
    if method == "CancelJob":  # the blocker must keep its slot: cancel a finished job (or an unknown one) instead
        hints["job_id"] = st.sampled_from(["", "nope", CANCELLED, "../x", "a" * 200])
    generic = hostile.message(m.input_type, hints)
    base = _near_valid().get((service, method))
    # half generic, half a valid request with some fields replaced: hostile values behind a valid rest
    return generic if base is None else st.one_of(generic, hostile.near(base, generic))


def _near_valid() -> dict:
    """A valid request per RPC (that has fields), the base of the near-valid examples."""
    step, answer = common_pb2.Step(text=SUBQUERY), common_pb2.Step(text=ANSWER)
    sampling = policy_pb2.SamplingParams(n=1, max_tokens=4, temperature=0.7, seed=3)
    valid = {("retriever", "Search"): retriever_pb2.SearchRequest(queries=["Who founded Mai Brewery?", "Harlow"],
                                                                  topk=2, index="bm25"),
             ("retriever", "GetDocuments"): retriever_pb2.GetDocumentsRequest(ids=["d1", "d2"]),
             ("policy", "GenerateSteps"): policy_pb2.GenerateStepsRequest(
                 prefixes=[policy_pb2.Prefix(text=QUESTION), policy_pb2.Prefix(token_ids=[5, 6, 7])],
                 sampling=sampling),
             ("policy", "Rollout"): policy_pb2.RolloutRequest(
                 questions=[policy_pb2.RolloutQuestion(id="q1", question=QUESTION)], sampling=sampling, max_steps=2,
                 topk=2, retriever_index="bm25"),
             ("policy", "LoadAdapter"): policy_pb2.LoadAdapterRequest(ref=common_pb2.AdapterRef(name="pol",
                                                                                                 version="v1")),
             ("policy", "ActivateAdapter"): policy_pb2.ActivateAdapterRequest(),
             ("policy", "UnloadAdapter"): policy_pb2.UnloadAdapterRequest(ref=common_pb2.AdapterRef(name="pol",
                                                                                                     version="v1")),
             ("prm", "ScoreSteps"): prm_pb2.ScoreStepsRequest(inputs=[prm_pb2.ScoringInput(
                 question=QUESTION, steps=[step, common_pb2.Step(text=SUBANSWER), answer])]),
             ("judge", "JudgePairs"): judge_pb2.JudgePairsRequest(items=[judge_pb2.JudgeItem(
                 id="ok", question_id="q1", question=QUESTION, golden_answers=["Edraand"],
                 candidates=[judge_pb2.Candidate(step=step, q_value=0.5, visits=2),
                             judge_pb2.Candidate(step=answer)])]),
             ("trainer", "StartJob"): trainer_pb2.StartJobRequest(stage="selftest", config_json='{"steps": 3}'),
             ("trainer", "WatchJob"): trainer_pb2.WatchJobRequest(job_id=CANCELLED),
             ("trainer", "CancelJob"): trainer_pb2.CancelJobRequest(job_id=CANCELLED),
             ("trainer", "GetJob"): trainer_pb2.GetJobRequest(job_id=BLOCKER),
             ("trainer", "ListJobs"): trainer_pb2.ListJobsRequest(stage="selftest")}
    return valid


# ---------------------------------------------------------------- the services


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    return generate_secrets(tmp_path_factory.mktemp("hostile-secrets"))


@pytest.fixture(scope="module", params=["auth-off", "auth-on"])
def stack(request, tiny_policy, secrets, tmp_path_factory):
    """The five services, started once per auth mode: name -> (grpc port, http port or None), plus the client
    security that gets a call past auth (the admin token over TLS when auth is on)."""
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
    from tests.conftest import single_thread
    from tests.search.test_judging import Q

    secured = request.param == "auth-on"
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    mp = pytest.MonkeyPatch()
    mp.setenv("PRORAG_DATA", str(tmp / "data"))
    model_dir, _ = tiny_policy
    build_stack_files(tmp, model_dir)

    def serve(http: bool) -> ServeConfig:
        tls = dict(tls_cert=secrets["server_cert"], tls_key=secrets["server_key"],
                   auth_tokens=secrets["tokens"]) if secured else {}
        # 1 MiB messages: a generated huge message crosses the cap (RESOURCE_EXHAUSTED) without costing much
        return ServeConfig(port=0, http_port=0 if http else -1, grace_s=1, max_message_mb=1, **tls)

    admin = ClientSecurity(token=open(secrets["token_admin"]).read().strip(), tls_ca=secrets["ca"],
                           tls_server_name="localhost") if secured else ClientSecurity()
    loop = LoopThread()
    with single_thread():
        started = {
            "retriever": loop.run(start_retriever(
                serve(True), RetrieverConfig(max_topk=10, max_batch=8, max_query_chars=256),
                engine=RetrievalEngine.from_dir(tmp / "index", default="bm25"))),
            "prm": loop.run(start_prm(serve(False), PRMServeConfig(max_items=4, max_steps=8),
                                      engine=PRMEngine(str(tmp / "prm"), max_len=0))),
            "judge": loop.run(start_judge(serve(False), JudgeConfig(max_items=4, max_candidates=4),
                                          engine=ReferenceJudge([Q]))),
            "trainer": loop.run(start_trainer(serve(False), TrainerConfig(
                jobs_root=str(tmp / "jobs"), tracking="local", parallel_jobs=1, max_queued_jobs=8))),
        }
        if secured:  # the policy's own calls to the retriever go through the same TLS and token settings
            mp.setenv("PRORAG_TLS_CA", secrets["ca"])
            mp.setenv("PRORAG_TOKEN_FILE", secrets["token_client"])
        started["policy"] = loop.run(start_policy(serve(True), PolicyConfig(
            model=str(model_dir), retriever=f"localhost:{started['retriever'].grpc_port}", retriever_timeout_s=10,
            max_n=4, max_tokens=16, default_step_tokens=8, max_prefix_tokens=256, max_prefixes=8, max_questions=4,
            max_question_chars=512, default_max_steps=3, max_steps=4, max_topk=5, max_concurrent_rollouts=2,
            max_queued_rollouts=2, max_request_tokens=1024, http_timeout_s=30)))
        ports = {name: (s.grpc_port, s.http_port) for name, s in started.items()}
        with secure_channel(f"localhost:{ports['trainer'][0]}", security=admin) as ch:
            # one long job holds the trainer's only slot, so a generated job that is accepted only queues
            _unary(ch, "trainer", "StartJob")(trainer_pb2.StartJobRequest(
                stage="selftest", job_id=BLOCKER, config_json=json.dumps({"steps": 1_000_000, "step_sleep_s": 1.0})),
                timeout=30)
            _unary(ch, "trainer", "StartJob")(trainer_pb2.StartJobRequest(stage="selftest", job_id=CANCELLED),
                                              timeout=30)
            _unary(ch, "trainer", "CancelJob")(trainer_pb2.CancelJobRequest(job_id=CANCELLED), timeout=30)
        try:
            yield {"ports": ports, "security": admin, "secured": secured, "secrets": secrets}
        finally:
            with secure_channel(f"localhost:{ports['trainer'][0]}", security=admin) as ch:
                try:
                    _unary(ch, "trainer", "CancelJob")(trainer_pb2.CancelJobRequest(job_id=BLOCKER), timeout=30)
                except grpc.RpcError:
                    pass
            for s in started.values():
                loop.run(s.stop())
            loop.close()
            mp.undo()


def _classes(service: str, method: str):
    m = DESCRIPTORS[service].methods_by_name[method]
    return m, message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type)


def _unary(channel, service: str, method: str):
    m, req, resp = _classes(service, method)
    path = f"/{DESCRIPTORS[service].full_name}/{method}"
    kw = dict(request_serializer=req.SerializeToString, response_deserializer=resp.FromString)
    if m.server_streaming:
        call = channel.unary_stream(path, **kw)
        return lambda request, **k: list(call(request, **k))
    return channel.unary_unary(path, **kw)


def _call(channel, service: str, method: str, request, metadata=None):
    """(status code, details, response) of one call; a stream is read to its end."""
    try:
        resp = _unary(channel, service, method)(request, timeout=TIMEOUT_S.get(method, 60.0), metadata=metadata)
        return grpc.StatusCode.OK, "", resp
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


def _assert_documented(code, details: str, what) -> None:
    assert code in DOCUMENTED, f"{what}: answered {code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert details.strip(), f"{what}: {code.name} without a message"
        assert "internal error" not in details and "Exception calling application" not in details, (what, details)


def _valid_requests(service: str) -> list[tuple[str, object, callable]]:
    """(method, request, check of the response) that a healthy service answers."""
    step = common_pb2.Step(text=SUBQUERY)
    return {
        "retriever": [("Search", retriever_pb2.SearchRequest(queries=["Who founded Mai Brewery?"], topk=1,
                                                             index="bm25"),
                       lambda r: r.results[0].documents[0].document.id == "d1")],
        "policy": [("GenerateSteps", policy_pb2.GenerateStepsRequest(
            prefixes=[policy_pb2.Prefix(text=QUESTION)], sampling=policy_pb2.SamplingParams(n=1, max_tokens=2)),
            lambda r: len(r.results) == 1 and len(r.results[0].completions) == 1)],
        "prm": [("ScoreSteps", prm_pb2.ScoreStepsRequest(inputs=[prm_pb2.ScoringInput(
            question=QUESTION, steps=[step, common_pb2.Step(text=SUBANSWER)])]),
            lambda r: len(r.results[0].scores) == 2)],
        "judge": [("JudgePairs", judge_pb2.JudgePairsRequest(items=[judge_pb2.JudgeItem(
            id="ok", question_id="q1", question=QUESTION,
            candidates=[judge_pb2.Candidate(step=step),
                        judge_pb2.Candidate(step=common_pb2.Step(text=ANSWER))])]),
            lambda r: len(r.verdicts) == 1 and r.verdicts[0].id == "ok")],
        "trainer": [("GetJob", trainer_pb2.GetJobRequest(job_id=BLOCKER), lambda r: r.job_id == BLOCKER)],
    }[service]


def assert_healthy(stack, service: str) -> None:
    """Health SERVING (liveness and the service's readiness), and a valid request answered as it should be."""
    port = stack["ports"][service][0]
    with secure_channel(f"localhost:{port}", security=stack["security"]) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", DESCRIPTORS[service].full_name):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, (service, name)
        for method, request, check in _valid_requests(service):
            code, details, resp = _call(ch, service, method, request)
            assert code == grpc.StatusCode.OK, (service, method, code, details)
            assert check(resp), (service, method, resp)


# ---------------------------------------------------------------- every RPC
@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s}.{m}" for s, m in METHODS])
def test_every_rpc_answers_generated_messages_with_a_documented_status(stack, service, method):
    port = stack["ports"][service][0]
    seen: dict[str, int] = {}
    with secure_channel(f"localhost:{port}", security=stack["security"]) as ch:

        @settings(max_examples=EXAMPLES.get(method, DEFAULT_EXAMPLES), deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(request=_strategy(service, method))
        def check(request):
            code, details, resp = _call(ch, service, method, request)
            _assert_documented(code, details, f"{service}.{method}({_short(request)})")
            seen[code.name] = seen.get(code.name, 0) + 1
            if service == "trainer" and method == "StartJob" and code == grpc.StatusCode.OK and \
                    resp.job_id != BLOCKER:
                # accepted: it only queued behind the blocker; cancel it before it can run
                c, d, _ = _call(ch, "trainer", "CancelJob", trainer_pb2.CancelJobRequest(job_id=resp.job_id))
                assert c in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), (c, d)

        check()
    # the generated messages reached past the first check: not everything was one refusal
    if method not in ("ListIndexes", "ListAdapters", "GetModelInfo", "GetJudgeInfo", "ListJobs"):
        assert len(seen) >= 2, (service, method, seen)
    assert_healthy(stack, service)


def _short(request) -> str:
    s = str(request).replace("\n", " ")
    return s if len(s) < 400 else s[:400] + f"... ({len(s)} chars)"


def test_a_message_over_the_size_cap_is_resource_exhausted(stack):
    port = stack["ports"]["retriever"][0]
    with secure_channel(f"localhost:{port}", security=stack["security"]) as ch:
        code, details, _ = _call(ch, "retriever", "Search",
                                 retriever_pb2.SearchRequest(queries=["x" * (2 << 20)], topk=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert_healthy(stack, "retriever")


# ---------------------------------------------------------------- tokens (auth on)
# only the secured stack: the parameter overrides the module fixture's params (no skipped auth-off cases)
@pytest.mark.parametrize("stack", ["auth-on"], indirect=True)
@pytest.mark.parametrize("service,method", [("retriever", "Search"), ("policy", "LoadAdapter"),
                                            ("trainer", "StartJob")])
def test_generated_tokens_are_refused(stack, service, method):
    """Any authorization value that is not a listed token (none, another scheme, a near miss, a long one) is
    UNAUTHENTICATED before a servicer runs."""
    token = open(stack["secrets"]["token_admin"]).read().strip()
    security = ClientSecurity(tls_ca=stack["secrets"]["ca"], tls_server_name="localhost")  # TLS, no token
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=80)
    values = st.one_of(printable, printable.map(lambda t: "Bearer " + t), st.just("Bearer"), st.just("Bearer  "),
                       st.just(f"Basic {token}"), st.just(f"Bearer {token[:-1]}"), st.just(f"Bearer {token}x"),
                       st.just("Bearer " + "A" * 10_000))
    _, req_cls, _ = _classes(service, method)
    with secure_channel(f"localhost:{stack['ports'][service][0]}", security=security) as ch:

        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(value=values)
        def check(value):
            code, details, _ = _call(ch, service, method, req_cls(), metadata=(("authorization", value),))
            # metadata past gRPC's 8 KiB soft limit is refused by the transport at random up to the hard limit
            allowed = {grpc.StatusCode.UNAUTHENTICATED} | ({grpc.StatusCode.RESOURCE_EXHAUSTED}
                                                           if len(value) > 8192 else set())
            assert code in allowed, (value[:100], code, details)

        check()
    assert_healthy(stack, service)


# ---------------------------------------------------------------- the HTTP APIs
def _http(stack, service: str, path: str, body: bytes, headers: dict | None = None,
          token: bool = True) -> tuple[int, bytes, str]:
    port = stack["ports"][service][1]
    if stack["secured"]:
        ctx = ssl.create_default_context(cafile=stack["secrets"]["ca"])
        conn = http.client.HTTPSConnection("localhost", port, timeout=60, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if stack["secured"] and token and "Authorization" not in hdrs:
        hdrs["Authorization"] = "Bearer " + open(stack["secrets"]["token_client"]).read().strip()
    try:
        conn.request("POST", path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("Content-Type", "")
    finally:
        conn.close()


def _assert_http_documented(status: int, payload: bytes, ctype: str, what: str) -> dict:
    assert status in HTTP_DOCUMENTED, f"{what}: HTTP {status}: {payload[:300]!r}"
    assert ctype.startswith("application/json"), f"{what}: HTTP {status} {ctype}: {payload[:300]!r}"
    data = json.loads(payload)
    if status != 200:
        err = data.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        assert isinstance(msg, str) and msg.strip(), (what, status, data)
        assert "internal error" not in msg, (what, status, msg)
    return data


def _bodies(fields: dict, valid: dict):
    """Generated objects, valid bodies with fields replaced or dropped, any JSON value, malformed bytes."""
    return hostile.body_bytes(st.one_of(hostile.json_object(fields), hostile.near_json(valid, fields)))


def _retrieve_fields() -> dict:
    return {"queries": st.lists(st.sampled_from(["Mai Brewery", "Harlow", "Tova Lunn born"]), min_size=1, max_size=3),
            "topk": st.integers(0, 12), "return_scores": st.booleans(), "index": INDEXES}


def _retrieve_bodies():
    return _bodies(_retrieve_fields(), {"queries": ["Who founded Mai Brewery?"], "topk": 2, "return_scores": True})


def _openai_fields() -> dict:
    return {"model": st.sampled_from(["", "pol@v1", "nope"]), "n": st.integers(0, 5),
            "max_tokens": st.integers(0, 20), "max_completion_tokens": st.integers(0, 20),
            "temperature": st.sampled_from([0.0, 0.7]), "top_p": st.sampled_from([0.5, 1.0]),
            "stop": st.one_of(st.sampled_from(list(STOP_TAGS)), st.lists(st.sampled_from(list(STOP_TAGS)), max_size=2)),
            "seed": st.integers(0, 100), "logprobs": st.one_of(st.none(), st.integers(0, 2))}


def _completion_fields() -> dict:
    prompt = st.one_of(st.sampled_from([QUESTION, "Hello"]), st.lists(st.sampled_from([QUESTION, "Hi"]), max_size=3))
    return {"prompt": prompt, **_openai_fields()}


def _completion_bodies():
    return _bodies(_completion_fields(), {"prompt": QUESTION, "max_tokens": 3})


def _chat_fields() -> dict:
    msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                 "content": st.sampled_from([QUESTION, "", "Hi"])})
    return {"messages": st.lists(msg, max_size=3), **_openai_fields()}


def _chat_bodies():
    return _bodies(_chat_fields(), {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3})


HTTP_CASES = {"retriever /retrieve": ("retriever", "/retrieve", _retrieve_bodies),
              "policy /v1/completions": ("policy", "/v1/completions", _completion_bodies),
              "policy /v1/chat/completions": ("policy", "/v1/chat/completions", _chat_bodies)}
HTTP_FIELDS = {"retriever /retrieve": _retrieve_fields, "policy /v1/completions": _completion_fields,
               "policy /v1/chat/completions": _chat_fields}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_apis_answer_generated_bodies_with_a_documented_status(stack, case):
    service, path, bodies = HTTP_CASES[case]
    seen: dict[int, int] = {}
    content_types = st.sampled_from(["application/json", "application/json", "text/plain", "",
                                     "application/json; charset=latin-1", "application/json; charset=nope"])

    @settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(), ctype=content_types)
    def check(body, ctype):
        status, payload, rtype = _http(stack, service, path, body, {"Content-Type": ctype})
        data = _assert_http_documented(status, payload, rtype, f"{case} {body[:200]!r}")
        seen[status] = seen.get(status, 0) + 1
        if status == 200 and service == "retriever":
            sent = json.loads(body)
            assert len(data["result"]) == len(sent["queries"])

    check()
    assert 200 in seen and 400 in seen, seen
    assert_healthy(stack, service)


def test_http_bodies_that_break_parsers_and_limits(stack):
    """Each malformed body, an oversized one, and (auth on) generated Authorization headers: documented statuses."""
    for service, path, _ in HTTP_CASES.values():
        for body in hostile.MALFORMED_BODIES:
            status, payload, rtype = _http(stack, service, path, body)
            _assert_http_documented(status, payload, rtype, f"{path} {body[:80]!r}")
            assert status >= 400, (path, body[:80], status)
        status, payload, rtype = _http(stack, service, path, b'{"queries": ["' + b"x" * (17 << 20) + b'"]}')
        assert status == 413, (path, status)
        _assert_http_documented(status, payload, rtype, f"{path} 17 MiB")
        if stack["secured"]:
            for header in (b"Bearer \xff\xfe", b"Bearer \xc3\xa9t\xc3\xa9", b"bearer", b"Bearer " + b"A" * 7000,
                           b"Digest x", b"Bearer \x00"):
                status, payload, rtype = _http(stack, service, path, b'{"queries": ["a"], "topk": 1}',
                                               {"Authorization": header})
                # 401 from the token check; 400 (plain text) from aiohttp's HTTP parser for a NUL in a header
                assert status in (400, 401), (path, header[:30], status, payload[:200])
                if status == 401:
                    _assert_http_documented(status, payload, rtype, f"{path} Authorization {header[:30]!r}")
        assert_healthy(stack, service)


# ---------------------------------------------------------------- every field x every wrong type (deterministic)
#: a value of every JSON type that some field does not take, and the numbers and strings that break conversions
WRONG_VALUES = [None, True, "x", "", 10 ** 400, -1, 2 ** 62, 1.5, float("nan"), float("inf"), "a" * 5000, "\x00",
                [1], {"a": 1}, "x\udc00"]
NOT_TEXT = "x\udc00"  # a lone surrogate (issue 51): refused naming the field, whatever the field takes


@pytest.mark.parametrize("stack", ["auth-off"], indirect=True)  # the answers do not depend on auth: swept once
def test_every_job_config_field_with_every_wrong_value(stack):
    """Each field of each stage's config set to each of WRONG_VALUES (a sweep the generated configs only sample):
    refused with INVALID_ARGUMENT naming the field, or accepted (then cancelled while queued)."""
    from services.trainer.stages import get_stage, known_stages, load_stage_modules

    load_stage_modules()
    answered: dict[str, int] = {}
    with secure_channel(f"localhost:{stack['ports']['trainer'][0]}", security=stack["security"]) as ch:
        for stage in known_stages():
            for field in dataclasses.fields(get_stage(stage).config_cls):
                for value in WRONG_VALUES:
                    request = trainer_pb2.StartJobRequest(stage=stage, config_json=json.dumps({field.name: value}))
                    code, details, resp = _call(ch, "trainer", "StartJob", request)
                    _assert_documented(code, details, f"{stage} {{{field.name}: {value!r:.40}}}")
                    if value == NOT_TEXT:
                        assert code == grpc.StatusCode.INVALID_ARGUMENT and \
                            f"config_json: {field.name} holds a lone low surrogate" in details, (stage, code, details)
                    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.FAILED_PRECONDITION), (stage, field.name, value, code, details)
                    answered[code.name] = answered.get(code.name, 0) + 1
                    if code == grpc.StatusCode.OK:
                        c, d, _ = _call(ch, "trainer", "CancelJob", trainer_pb2.CancelJobRequest(job_id=resp.job_id))
                        assert c == grpc.StatusCode.OK, (c, d)
        for body in hostile.MALFORMED_BODIES:  # config_json that breaks the JSON parser
            code, details, _ = _call(ch, "trainer", "StartJob", trainer_pb2.StartJobRequest(
                stage="selftest", config_json=body.decode("utf-8", "replace")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT or (code == grpc.StatusCode.OK
                                                                and body in (b"", b"null")), \
                (body[:40], code, details)
            if code == grpc.StatusCode.OK:
                _call(ch, "trainer", "CancelJob", trainer_pb2.CancelJobRequest(job_id=_.job_id))
    assert answered.get("INVALID_ARGUMENT") and answered.get("OK"), answered
    assert_healthy(stack, "trainer")


HTTP_VALID = {"retriever /retrieve": {"queries": ["Who founded Mai Brewery?"], "topk": 2, "return_scores": True,
                                      "index": "bm25"},
              "policy /v1/completions": {"model": "", "prompt": QUESTION, "n": 1, "max_tokens": 3, "temperature": 0.7,
                                         "top_p": 1.0, "stop": "</subquery>", "seed": 1, "logprobs": 1,
                                         "max_completion_tokens": 3},
              "policy /v1/chat/completions": {"model": "", "messages": [{"role": "user", "content": QUESTION}],
                                              "n": 1, "max_tokens": 3, "temperature": 0.7, "top_p": 1.0,
                                              "stop": ["<|im_end|>"], "seed": 1}}


@pytest.mark.parametrize("stack", ["auth-off"], indirect=True)  # the answers do not depend on auth: swept once
@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_every_http_field_with_every_wrong_value(stack, case):
    """A valid body answered 200, and the same body with each field set to each of WRONG_VALUES: 200 or a 4xx
    with a JSON error."""
    service, path, _ = HTTP_CASES[case]
    valid = HTTP_VALID[case]
    status, payload, rtype = _http(stack, service, path, json.dumps(valid).encode())
    assert status == 200, (case, status, payload[:300])
    for field in valid:
        for value in WRONG_VALUES:
            body = json.dumps({**valid, field: value}).encode()
            status, payload, rtype = _http(stack, service, path, body)
            data = _assert_http_documented(status, payload, rtype, f"{case} {field}={value!r:.40}")
            if value == NOT_TEXT:
                assert status == 400 and f"request body: {field} holds a lone" in _message(data), (case, status, data)
    assert_healthy(stack, service)


def _message(data: dict) -> str:
    err = data.get("error")
    return err.get("message", "") if isinstance(err, dict) else str(err)


# ---------------------------------------------------------------- strings that are not text (issue 51)
#: examples per route / for the job configs: each is one refused request (a few ms), so these are cheap
NOT_TEXT_EXAMPLES = 40


def _text_bodies(case: str):
    """A body of the route whose strings are all text: the valid one with some fields replaced by plausible values
    (lists of several queries, prompts or messages) or dropped."""
    valid, fields = HTTP_VALID[case], HTTP_FIELDS[case]()

    @st.composite
    def build(draw):
        body = dict(valid)
        for name, plausible in fields.items():
            choice = draw(st.sampled_from(["keep", "keep", "replace", "drop"]))
            if choice == "replace":
                body[name] = draw(plausible)
            elif choice == "drop" and name not in ("queries", "prompt", "messages"):
                body.pop(name, None)
        return body

    return build()


def _assert_refused_naming(stack, case: str, body: bytes, path: str) -> None:
    service, route, _ = HTTP_CASES[case]
    status, payload, rtype = _http(stack, service, route, body)
    data = _assert_http_documented(status, payload, rtype, f"{case} {body[:200]!r}")
    assert status == 400, (case, path, status, data)
    assert f"request body: {path} holds a lone" in _message(data), (case, path, data)


def _assert_http_healthy(stack, case: str) -> None:
    service, route, _ = HTTP_CASES[case]
    status, payload, _ = _http(stack, service, route, json.dumps(HTTP_VALID[case]).encode())
    assert status == 200, (case, status, payload[:300])
    assert_healthy(stack, service)


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_a_lone_surrogate_in_every_string_of_a_valid_body_is_a_400_naming_it(stack, case):
    """Each string (and key) of the route's valid body, in turn, with a lone surrogate, escaped (\\udc00), raw
    (its UTF-8 bytes) and in a UTF-16 body: 400 naming its JSON path, never reaching a tokenizer or an index."""
    valid = HTTP_VALID[case]
    slots = hostile.string_slots(valid)
    # every key, and every string value
    assert sum(isinstance(loc[-1], tuple) for _, loc in slots) >= len(valid), slots
    assert {p for p, loc in slots} >= {k for k, v in valid.items() if isinstance(v, str)}, slots
    for path, loc in slots:
        for how in hostile.ENCODINGS:
            body = hostile.spoil(valid, loc, "\udc00", 0)
            expected = f'{path}[{json.dumps(chr(0xdc00) + loc[-1][1])}] (a key)' if isinstance(loc[-1], tuple) \
                else path
            _assert_refused_naming(stack, case, hostile.encode(body, how), expected)
    _assert_http_healthy(stack, case)


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_generated_bodies_with_a_lone_surrogate_are_a_400_naming_it(stack, case):
    """Generated bodies of text (several queries, prompts, messages) with a lone surrogate put into one string or
    key, escaped, raw or UTF-16: 400 naming its path; the route still answers a valid body."""

    @settings(max_examples=NOT_TEXT_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spoilt=hostile.spoiled(_text_bodies(case)))
    def check(spoilt):
        body, path = spoilt
        _assert_refused_naming(stack, case, body, path)

    check()
    _assert_http_healthy(stack, case)


def _default_configs():
    """A stage and a config of text: its defaults (every field, strings included), some dropped."""
    from prorag.config import to_dict
    from services.trainer.stages import get_stage, known_stages, load_stage_modules

    load_stage_modules()
    defaults = {name: to_dict(get_stage(name).config_cls()) for name in known_stages()}

    @st.composite
    def build(draw):
        stage = draw(st.sampled_from(sorted(defaults)))
        config = {k: v for k, v in defaults[stage].items() if draw(st.integers(0, 3))}
        return stage, config or {"tracking": "local"}

    return build()


def test_a_job_config_with_a_lone_surrogate_is_invalid_argument_naming_it(stack):
    """A stage's config with a lone surrogate in one string or key (a \\udc00 escape in config_json: a protobuf
    string is UTF-8, so the escape is how one arrives over gRPC): INVALID_ARGUMENT naming its path, before any
    string is used as a path or an endpoint; the trainer stays healthy."""
    configs = _default_configs()

    @st.composite
    def requests(draw):
        stage, config = draw(configs)
        body, path = draw(hostile.spoiled(st.just(config)))
        # escaped JSON is ASCII: re-encoded the same way whatever encoding spoiled() drew
        text = json.dumps(json.loads(body))
        return stage, text, path

    with secure_channel(f"localhost:{stack['ports']['trainer'][0]}", security=stack["security"]) as ch:

        @settings(max_examples=NOT_TEXT_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request=requests())
        def check(request):
            stage, config_json, path = request
            code, details, _ = _call(ch, "trainer", "StartJob",
                                     trainer_pb2.StartJobRequest(stage=stage, config_json=config_json))
            _assert_documented(code, details, f"{stage} {config_json[:200]}")
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (stage, path, code, details)
            assert f"config_json: {path} holds a lone" in details, (stage, path, details)

        check()
    assert_healthy(stack, "trainer")
