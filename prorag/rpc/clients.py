"""Typed clients for the ProRAG services, with deadlines on every call and message limits
matching the servers'. Other systems can use these or the protos directly."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag.data.loaders import Document
from prorag.errors import DeadlineExceeded, Unavailable
from prorag.pb import retriever_pb2, retriever_pb2_grpc
from prorag.pb import common_pb2, judge_pb2, judge_pb2_grpc, policy_pb2, policy_pb2_grpc, prm_pb2, prm_pb2_grpc
from prorag.rpc.observability import RequestIdForwarding
from prorag.rpc.pbconv import document_from_pb, scored_document_from_pb, step_pb
from prorag.rpc.security import ClientSecurity, secure_channel

MiB = 1024 * 1024


# Calls spread over every address a target resolves to (the pods of a headless Service, or an
# ``ipv4:a:p,b:p`` list) instead of gRPC's default of sticking to the first one.
ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


def channel(target: str, max_message_mb: int = 64, security: ClientSecurity | None = None,
            extra_options: list | None = None) -> grpc.Channel:
    """A channel with the servers' message limits, round-robin over the target's addresses, and the TLS and
    token settings of ``security`` (default: PRORAG_TLS_CA, PRORAG_TOKEN_FILE, ... from the environment,
    see :mod:`prorag.rpc.security`). A call made while serving a request carries that request's id
    (:mod:`prorag.rpc.observability`)."""
    return grpc.intercept_channel(secure_channel(target, [
        ("grpc.max_receive_message_length", max_message_mb * MiB),
        ("grpc.max_send_message_length", max_message_mb * MiB),
        ROUND_ROBIN,
    ] + list(extra_options or []), security), RequestIdForwarding())


def wait_for_health(target: str, service: str = "", timeout: float = 60.0) -> bool:
    """Poll grpc.health.v1 until ``service`` is SERVING or ``timeout`` passes; True if serving."""
    deadline = time.monotonic() + timeout
    # This loop is the backoff. gRPC's own reconnect backoff grows to minutes (1 s x 1.6 per failure), so a
    # channel that failed while a slow service loaded its model would notice it live only tens of seconds late.
    with channel(target, extra_options=FAST_RECONNECT) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


_retry_lock = threading.Lock()


#: calls made once more after their deadline ran out (call_with_service_wait): a stall the service recovers from
#: (a paused host, a long collection) should not fail an hour-long job, but a service that cannot keep up should
DEADLINE_RETRIES = 1
#: how long a service whose call ran out of time gets to answer its health check before the retry
DEADLINE_HEALTH_S = 30.0


def call_with_service_wait(fn, target: str, what: str, wait_s: float, stats: dict | None = None, after_back=None):
    """fn() again whenever it fails with UNAVAILABLE (the service died, or restarts), once the service at
    ``target`` answers its health check again; at most ``wait_s`` seconds of waiting in all (each health probe
    adds at most 2 s), then :class:`prorag.errors.Unavailable` naming the service (``what``) and its address.

    A call whose deadline runs out (DEADLINE_EXCEEDED) is made once more (DEADLINE_RETRIES) when the service
    answers its health check within DEADLINE_HEALTH_S; the next one raises :class:`prorag.errors.DeadlineExceeded`
    naming the service. The services stop the work of a call whose caller went away, so the retry does not
    double their load.

    fn must make the whole call again with the same request (the same sampling seed), so a retried call
    returns what the interrupted one would have; partial results of a stream are dropped by making fn consume
    the stream (``list(...)``). after_back(): run once the service is back, before the retry (e.g. push the
    adapter again). stats["service_retries"] counts the retries (thread-safe)."""
    deadline = time.monotonic() + wait_s
    attempt = 0
    overdue = 0
    while True:
        if attempt > 1:  # healthy again but the call still fails: the channel is reconnecting; do not spin
            time.sleep(max(0.0, min(0.05 * 2 ** min(attempt, 6), deadline - time.monotonic())))
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                overdue += 1
                if overdue > DEADLINE_RETRIES or not wait_for_health(target, "", timeout=DEADLINE_HEALTH_S):
                    raise DeadlineExceeded(
                        f"the {what} service at {target} did not answer within the call's deadline "
                        f"{overdue} time(s) ({e.details()}): it is overloaded or stalled; the job can be resumed "
                        "from its last checkpoint once it keeps up") from None
                if stats is not None:
                    with _retry_lock:
                        stats["service_retries"] = stats.get("service_retries", 0) + 1
                continue
            attempt += 1
            left = deadline - time.monotonic()
            if e.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # the wait is spent: say which service, where
                    raise Unavailable(f"the {what} service at {target} is unavailable ({e.details()}) and "
                                      f"service_wait_s={wait_s:g}s is spent; the job can be resumed from its last "
                                      "checkpoint once it is up") from None
                raise
            if stats is not None:
                with _retry_lock:
                    stats["service_retries"] = stats.get("service_retries", 0) + 1
            if not wait_for_health(target, "", timeout=left):
                raise Unavailable(f"the {what} service at {target} went away ({e.details()}) and did not come "
                                  f"back within service_wait_s={wait_s:g}s; the job can be resumed from its last "
                                  "checkpoint once it is up") from None
            if after_back is not None:
                after_back()


class _Client:
    """Channel lifetime shared by the typed clients (usable as context managers)."""

    _channel: grpc.Channel

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RetrieverClient(_Client):
    def __init__(self, target: str, timeout: float = 30.0, max_message_mb: int = 64):
        self.target = target
        self.timeout = timeout
        self._channel = channel(target, max_message_mb)
        self._stub = retriever_pb2_grpc.RetrieverStub(self._channel)
        self._max_batch: int | None = None

    def search(self, queries: list[str], topk: int = 3, index: str = "",
               timeout: float | None = None) -> list[list[Document]]:
        """Per query, its top ``topk`` documents best first, each with its score and 1-based rank.

        More queries than the server takes in one request (its max_batch, asked once) go in several."""
        limit = self.max_batch(timeout)
        out: list[list[Document]] = []
        for i in range(0, len(queries), limit) if queries else [0]:
            resp = self._stub.Search(retriever_pb2.SearchRequest(queries=queries[i:i + limit], topk=topk, index=index),
                                     timeout=timeout or self.timeout)
            out += [[scored_document_from_pb(d) for d in r.documents] for r in resp.results]
        return out

    def max_batch(self, timeout: float | None = None) -> int:
        """The most queries the server takes in one Search (learned from ListIndexes once; 256 if it cannot say)."""
        if self._max_batch is None:
            try:
                self._max_batch = max(1, self.list_indexes(timeout=timeout).max_batch) or 256
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise
                return 256  # unknown for now (server starting?): a size every retriever takes; ask again next time
        return self._max_batch

    def get_documents(self, ids: list[str], timeout: float | None = None, chunk: int = 256) -> list[Document]:
        out = []
        for i in range(0, len(ids), chunk):  # chunks stay under any server's max_batch
            resp = self._stub.GetDocuments(retriever_pb2.GetDocumentsRequest(ids=ids[i:i + chunk]),
                                           timeout=timeout or self.timeout)
            out += [document_from_pb(d) for d in resp.documents]
        return out

    def list_indexes(self, timeout: float | None = None) -> retriever_pb2.ListIndexesResponse:
        return self._stub.ListIndexes(retriever_pb2.ListIndexesRequest(), timeout=timeout or self.timeout)



class PolicyClient(_Client):
    """Typed client of prorag.v1.Policy (generation, rollouts, adapters)."""

    def __init__(self, target: str, timeout: float = 600.0, max_message_mb: int = 64):
        self._pb = policy_pb2
        self.target = target
        self.timeout = timeout
        self._channel = channel(target, max_message_mb)
        self._stub = policy_pb2_grpc.PolicyStub(self._channel)

    def sampling(self, n: int = 1, temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 0,
                 stop: list[str] | None = None, seed: int = 0, tempered_logprobs: bool | None = None):
        """tempered_logprobs: the kind of log-probs a caller that reads them needs (None: the engine's own)."""
        kind = {} if tempered_logprobs is None else {"tempered_logprobs": bool(tempered_logprobs)}
        return self._pb.SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                       stop=stop or [], seed=seed, **kind)

    def generate_steps(self, prefixes: list, sampling=None, adapter: str = "", timeout: float | None = None):
        """prefixes: list of str (text) or list[int] (token ids)."""
        pbs = [self._pb.Prefix(text=p) if isinstance(p, str) else self._pb.Prefix(token_ids=list(p)) for p in prefixes]
        return self._stub.GenerateSteps(self._pb.GenerateStepsRequest(
            prefixes=pbs, sampling=sampling or self.sampling(), adapter=adapter), timeout=timeout or self.timeout)

    def rollout(self, questions: list[tuple[str, str]], sampling=None, max_steps: int = 0, topk: int = 0,
                retriever_index: str = "", adapter: str = "", timeout: float | None = None, question_offset: int = 0):
        """Yields Trajectory messages as they finish, then returns (the summary is yielded last as a RolloutSummary).
        question_offset: the place of the first question in a larger request split into parts (its seeds follow)."""
        req = self._pb.RolloutRequest(questions=[self._pb.RolloutQuestion(id=i, question=q) for i, q in questions],
                                      sampling=sampling or self.sampling(), max_steps=max_steps, topk=topk,
                                      retriever_index=retriever_index, adapter=adapter, question_offset=question_offset)
        for ev in self._stub.Rollout(req, timeout=timeout or self.timeout):
            yield ev.trajectory if ev.HasField("trajectory") else ev.summary

    def load_adapter(self, name: str, version: str, path: str = "", timeout: float | None = None):
        return self._stub.LoadAdapter(self._pb.LoadAdapterRequest(ref=common_pb2.AdapterRef(name=name, version=version),
                                                                  path=path), timeout=timeout or self.timeout)

    def activate_adapter(self, name: str, version: str, timeout: float | None = None):
        return self._stub.ActivateAdapter(self._pb.ActivateAdapterRequest(
            ref=common_pb2.AdapterRef(name=name, version=version)), timeout=timeout or self.timeout)

    def unload_adapter(self, name: str, version: str, timeout: float | None = None):
        return self._stub.UnloadAdapter(self._pb.UnloadAdapterRequest(
            ref=common_pb2.AdapterRef(name=name, version=version)), timeout=timeout or self.timeout)

    def list_adapters(self, timeout: float | None = None):
        return self._stub.ListAdapters(self._pb.ListAdaptersRequest(), timeout=timeout or self.timeout)

    def model_info(self, timeout: float | None = None):
        return self._stub.GetModelInfo(self._pb.GetModelInfoRequest(), timeout=timeout or self.timeout)



class JudgeClient(_Client):
    """Typed client of prorag.v1.Judge: which of two or more sibling steps is sound progress, which is flawed."""

    def __init__(self, target: str, timeout: float = 120.0, max_message_mb: int = 64):
        self._pb = judge_pb2
        self.target = target
        self.timeout = timeout
        self._channel = channel(target, max_message_mb)
        self._stub = judge_pb2_grpc.JudgeStub(self._channel)

    def judge(self, items, timeout: float | None = None):
        """items: (id, question_id, question, golden answers, history steps, candidate steps, q values, visits)
        tuples; returns one Verdict per item (chosen / rejected candidate index, -1 = none; rationale)."""
        pbs = [self._pb.JudgeItem(
            id=i, question_id=qid, question=q, golden_answers=list(golden), history=[step_pb(s) for s in history],
            candidates=[self._pb.Candidate(step=step_pb(c), q_value=float(v), visits=int(n))
                        for c, v, n in zip(cands, values, visits)])
            for i, qid, q, golden, history, cands, values, visits in items]
        return list(self._stub.JudgePairs(self._pb.JudgePairsRequest(items=pbs), timeout=timeout or self.timeout)
                    .verdicts)

    def info(self, timeout: float | None = None):
        return self._stub.GetJudgeInfo(self._pb.JudgeInfoRequest(), timeout=timeout or self.timeout)


class PRMClient(_Client):
    """Typed client of prorag.v1.ProcessRewardModel: scores of reasoning steps, every step of a trajectory in one
    pass, with the model version that produced them."""

    def __init__(self, target: str, timeout: float = 120.0, max_message_mb: int = 64):
        self._pb = prm_pb2
        self.target = target
        self.timeout = timeout
        self._channel = channel(target, max_message_mb)
        self._stub = prm_pb2_grpc.ProcessRewardModelStub(self._channel)

    def score(self, inputs, timeout: float | None = None) -> tuple[str, list[list[float]]]:
        """inputs: (question, steps, last_step_only) tuples -> (model version, per input its step scores)."""
        req = self._pb.ScoreStepsRequest(inputs=[
            self._pb.ScoringInput(question=q, steps=[step_pb(s) for s in steps], last_step_only=bool(last))
            for q, steps, last in inputs])
        resp = self._stub.ScoreSteps(req, timeout=timeout or self.timeout)
        return resp.model_version, [list(r.scores) for r in resp.results]


def resolve_replicas(target: str) -> list[str]:
    """Every address behind a policy target, one ``host:port`` per replica.

    ``dns:///prorag-policy-headless:50052`` or ``prorag-policy-headless:50052`` (a headless Service: one
    A record per pod) -> every resolved IP; ``ipv4:10.0.0.1:50052,10.0.0.2:50052`` (gRPC's static list)
    and ``a:1,b:2`` -> those addresses. The lookup is made now: call it again to see replicas that came
    or went."""
    target = target.strip()
    if target.startswith("ipv4:") or target.startswith("ipv6:"):
        return [a.strip() for a in target.split(":", 1)[1].split(",") if a.strip()]
    if "," in target:
        return [a.strip() for a in target.split(",") if a.strip()]
    if target.startswith("dns:"):
        target = target[4:].lstrip("/")
        if "/" in target:  # dns://authority/host:port
            target = target.split("/", 1)[1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"policy target {target!r} is not host:port")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve the policy replicas of {target!r}: {e}") from None
    seen: list[str] = []
    for family, *_, addr in infos:
        hostport = f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}"
        if hostport not in seen:
            seen.append(hostport)
    return seen


def push_adapter(replicas: list[str] | str, name: str, version: str, activate: bool = True,
                 timeout: float = 120.0) -> list:
    """Load (and activate) ``name@version`` on every policy replica and wait for each; one ReplicaAck per replica.

    ``replicas`` is a list of addresses or one target that :func:`resolve_replicas` expands (a headless
    Service's pod IPs in k8s); every replica is attempted even when one fails, so the caller sees exactly
    which ones hold the version. A replica that restarts later loads the active version by itself."""
    if isinstance(replicas, str):
        replicas = resolve_replicas(replicas)

    def one(target: str):
        t0 = time.monotonic()
        try:
            with PolicyClient(target, timeout=timeout) as c:
                c.load_adapter(name, version)
                if activate:
                    c.activate_adapter(name, version)
            return common_pb2.ReplicaAck(replica=target, ok=True, latency_s=time.monotonic() - t0)
        except grpc.RpcError as e:
            return common_pb2.ReplicaAck(replica=target, ok=False, error=f"{e.code().name}: {e.details()}",
                                         latency_s=time.monotonic() - t0)

    with cf.ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        return list(pool.map(one, replicas))
