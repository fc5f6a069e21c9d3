"""`prorag bench retriever`: batch-64 throughput of the retriever service against the same engine in process,
then Search-R1's load shapes against our gRPC and HTTP (security off and on), the engine in process and, with
``--reference-url``, an external Search-R1-compatible ``/retrieve`` server."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag import paths
from prorag.data.loaders import load_split
from prorag.pb import retriever_pb2, retriever_pb2_grpc
from prorag.rpc.clients import channel
from prorag.rpc.pbconv import scored_document_from_pb
from prorag.rpc.security import ClientSecurity, generate_secrets
from prorag_app.bench.harness import free_ports, load_average, machine, median_dicts, percentile, serve, stop
from prorag_app.embedded import ensure_indexes

if TYPE_CHECKING:
    from prorag.rpc.security import ClientSecurity

#: name -> (concurrent clients, queries per request): Search-R1's rollout callers (one question at a time),
#: many of them at once, and a whole rollout batch in one request
SHAPES = {"1x1": (1, 1), "16x1": (16, 1), "1x64": (1, 64)}


# ---------------------------------------------------------------- callers and how they are driven
def _time_calls(fn, batches, warmup: int = 3) -> dict:
    """Queries/s of ``fn`` over ``batches`` one after another, and the p50/p95 seconds of one batch."""
    for b in batches[:warmup]:
        fn(b)
    lat = []
    t0 = time.perf_counter()
    for b in batches:
        s = time.perf_counter()
        fn(b)
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    n_queries = sum(len(b) for b in batches)
    return {"qps": n_queries / wall, "batch_latency_p50_s": percentile(lat, 0.5),
            "batch_latency_p95_s": percentile(lat, 0.95)}


def _concurrent(fn, batches, clients: int) -> dict:
    """``clients`` threads each sending their share of ``batches`` at once: server-side batching at work."""
    shares = [batches[i::clients] for i in range(clients)]
    errors = []

    def worker(share):
        for b in share:
            try:
                fn(b)
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in shares]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"qps": sum(len(b) for b in batches) / wall, "clients": clients, "errors": len(errors)}


def shape_plan(pool: list[str], clients: int, per_req: int, n_requests: int) -> list[list[list[str]]]:
    """Per client, its list of requests (each a list of queries), drawn round-robin from ``pool``."""
    plan, i = [], 0
    for _ in range(clients):
        reqs = []
        for _ in range(n_requests):
            reqs.append([pool[(i + j) % len(pool)] for j in range(per_req)])
            i += per_req
        plan.append(reqs)
    return plan


def run_shape(make_caller, plan: list[list[list[str]]], warmup: int = 3) -> dict:
    """Every client (own thread, own connection from ``make_caller()``) sends its requests back to back after a
    common start; per-request latency and total queries/s over the wall time of the whole run."""
    n = len(plan)
    callers = [make_caller() for _ in range(n)]
    lats: list[list[float]] = [[] for _ in range(n)]
    errors: list[str] = []
    start = threading.Barrier(n + 1)

    def worker(c: int) -> None:
        call = callers[c]
        try:
            for qs in plan[c][:warmup]:
                call(qs)
        except Exception as e:  # noqa: BLE001 - counted, reported
            errors.append(repr(e)[:300])
        start.wait()
        for qs in plan[c]:
            t = time.perf_counter()
            try:
                call(qs)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e)[:300])
                continue
            lats[c].append(time.perf_counter() - t)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in callers:
        getattr(c, "close", lambda: None)()
    lat = [x for l in lats for x in l]
    queries = sum(len(qs) for c in range(n) for qs in plan[c])
    if not lat:
        return {"qps": 0.0, "p50_ms": float("nan"), "p95_ms": float("nan"), "errors": len(errors),
                "error_sample": errors[:1]}
    return {"qps": queries / wall, "p50_ms": 1e3 * percentile(lat, 0.5), "p95_ms": 1e3 * percentile(lat, 0.95),
            "errors": len(errors)}


class HttpCaller:
    """One keep-alive HTTP(S) connection posting Search-R1's ``/retrieve`` body; checks the answer's shape."""

    def __init__(self, url: str, topk: int, security=None):
        u = urllib.parse.urlsplit(url)
        self.path, self.topk = u.path or "/retrieve", topk
        self.headers = {"Content-Type": "application/json"}
        auth = security.authorization() if security is not None else None
        if auth:
            self.headers["Authorization"] = auth
        if u.scheme == "https":
            ctx = security.ssl_context() if security is not None else ssl.create_default_context()
            name = (security.tls_server_name if security is not None else "") or u.hostname

            class _Conn(http.client.HTTPSConnection):
                def connect(self):  # verify the certificate for ``name`` while dialling the URL's address
                    http.client.HTTPConnection.connect(self)
                    self.sock = ctx.wrap_socket(self.sock, server_hostname=name)

            self.conn = _Conn(u.hostname, u.port, timeout=120, context=ctx)
        else:
            self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)

    def __call__(self, qs: list[str]) -> None:
        body = json.dumps({"queries": qs, "topk": self.topk, "return_scores": True}).encode()
        self.conn.request("POST", self.path, body=body, headers=self.headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        result = json.loads(data)["result"]
        if len(result) != len(qs) or any(len(docs) != self.topk for docs in result):
            raise RuntimeError("wrong number of results")

    def close(self) -> None:
        self.conn.close()


class GrpcCaller:
    """One channel calling prorag.v1.Retriever/Search, documents converted as RetrieverClient does."""

    def __init__(self, target: str, topk: int, index: str, security=None):
        self._pb, self._conv = retriever_pb2, scored_document_from_pb
        self.channel = channel(target, security=security)
        self.stub = retriever_pb2_grpc.RetrieverStub(self.channel)
        self.topk, self.index = topk, index

    def __call__(self, qs: list[str]) -> None:
        resp = self.stub.Search(self._pb.SearchRequest(queries=qs, topk=self.topk, index=self.index), timeout=120)
        out = [[self._conv(d) for d in r.documents] for r in resp.results]
        if len(out) != len(qs) or any(len(docs) != self.topk for docs in out):
            raise RuntimeError("wrong number of results")

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------- the servers under test
@dataclass(frozen=True)
class _Server:
    """One ``prorag serve retriever`` process of the benchmark and how a client reaches it."""

    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    security: ClientSecurity
    scheme: str = "http"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def _start_server(world: str, index: str, security: ClientSecurity, log_path: Path, env_extra: dict | None = None,
                  scheme: str = "http") -> _Server:
    """``prorag serve retriever`` in its own process (its default index = ``index``) on free gRPC and HTTP ports."""
    grpc_port, http_port = free_ports(2)
    proc = serve("retriever", grpc_port, {"world": world, "default_index": index}, log_path, http_port=http_port,
                 env=dict(os.environ, **(env_extra or {})))
    return _Server(proc, grpc_port, http_port, security, scheme)


def _wait_serving(target: str, security, timeout: float = 180.0) -> bool:
    """grpc.health.v1 of the retriever over ``security`` (TLS servers need the CA even for health)."""
    deadline = time.monotonic() + timeout
    with channel(target, security=security) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service="prorag.v1.Retriever"),
                              timeout=2.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
    return False


def _start_servers(world: str, index: str, secure: bool, tmp: Path) -> dict[str, _Server]:
    """The plain server under "" and, with ``secure``, one with TLS and a bearer token under "_secure" (the
    suffixes of their targets' names), each serving before the next starts; on a failure every one started is
    stopped."""
    servers: dict[str, _Server] = {}
    try:
        plain = servers[""] = _start_server(world, index, ClientSecurity(), tmp / "plain.log")
        if not _wait_serving(plain.grpc_target, plain.security):
            raise SystemExit("retriever server did not start for the benchmark: "
                             f"{(tmp / 'plain.log').read_text()[-2000:]}")
        if secure:
            s = generate_secrets(tmp / "secrets")
            security = ClientSecurity.from_env({"PRORAG_TLS_CA": s["ca"], "PRORAG_TOKEN_FILE": s["token_client"],
                                                "PRORAG_TLS_SERVER_NAME": "localhost"})
            tls = servers["_secure"] = _start_server(
                world, index, security, tmp / "secure.log", {"PRORAG_TLS_CERT": s["server_cert"],
                                                             "PRORAG_TLS_KEY": s["server_key"],
                                                             "PRORAG_AUTH_TOKENS": s["tokens"]}, scheme="https")
            if not _wait_serving(tls.grpc_target, tls.security):
                raise SystemExit("the TLS + token retriever did not start for the benchmark: "
                                 f"{(tmp / 'secure.log').read_text()[-2000:]}")
    except BaseException:
        stop(*(srv.proc for srv in servers.values()))
        raise
    return servers


# ---------------------------------------------------------------- the benchmark, step by step
def _query_pool(world: str) -> list[str]:
    """The test split's gold sub-questions (what a rollout searches), else its whole questions."""
    questions = load_split(paths.world_dir(world), "test")
    return [s.question for q in questions for s in q.decomposition] or [q.question for q in questions]


def _batches(pool: list[str], batch: int, iters: int) -> tuple[list[list[str]], list[list[str]]]:
    """``iters`` batches of ``batch`` queries drawn round-robin from ``pool``, and batch-8 slices of the first
    quarter of them (at least 4) for the concurrency run."""
    batches = [[pool[(i * batch + j) % len(pool)] for j in range(batch)] for i in range(iters)]
    firsts = [q for b in batches[: max(4, iters // 4)] for q in b[:8]]
    return batches, [firsts[i:i + 8] for i in range(0, len(firsts), 8)]


def _batch_throughput(engine, server: _Server, batches, small, topk: int, index: str, repeats: int) -> dict:
    """The result's top-level figures: batch-``batch`` throughput in process, over gRPC and over HTTP, and 8 gRPC
    clients x batch 8 against batch 8 in process; per path, one run per repeat."""
    grpc_call = GrpcCaller(server.grpc_target, topk, index)
    http_call = HttpCaller(f"http://127.0.0.1:{server.http_port}/retrieve", topk)

    def inprocess(qs):
        return engine.search(qs, topk, index)

    runs = {"inprocess": [], "grpc": [], "http": [], "grpc_concurrent_8x8": [], "inprocess_8": []}
    for _ in range(repeats):
        # Interleaved so drift (thermal, other load) hits every path alike.
        runs["inprocess"].append(_time_calls(inprocess, batches))
        runs["grpc"].append(_time_calls(grpc_call, batches))
        runs["http"].append(_time_calls(http_call, batches))
        runs["inprocess_8"].append(_time_calls(inprocess, small))
        runs["grpc_concurrent_8x8"].append(_concurrent(grpc_call, small, 8))
    grpc_call.close()
    http_call.close()
    return runs


def _shape_targets(engine, servers: dict[str, _Server], topk: int, index: str, reference: str) -> dict:
    """Target name -> a function making one caller of it: the engine in process, gRPC and HTTP of every server
    (named with its suffix), and the reference server when one is given."""
    targets = {"inprocess": lambda: (lambda qs: engine.search(qs, topk, index))}
    for suffix, srv in servers.items():
        targets["grpc" + suffix] = lambda srv=srv: GrpcCaller(srv.grpc_target, topk, index, srv.security)
        targets["http" + suffix] = lambda srv=srv: HttpCaller(f"{srv.scheme}://127.0.0.1:{srv.http_port}/retrieve",
                                                              topk, srv.security)
    if reference:
        targets["reference"] = lambda: HttpCaller(reference, topk)
    return targets


def _shape_requests(clients: int, per_request: int, n_single: int) -> int:
    """Requests per client of a shape: ``n_single`` for the one client asking one query at a time, twice as many
    shared among many such clients, a twentieth as many whole batches (at least 5 each)."""
    if per_request == 1:
        return n_single if clients == 1 else max(5, 2 * n_single // clients)
    return max(5, n_single // 20)


def _run_shapes(targets: dict, plans: dict, repeats: int) -> tuple[dict, list]:
    """Every target at every shape, targets interleaved within each repeat: target -> shape -> runs; and the load
    average before each repeat and after the last."""
    shape_runs: dict = {t: {s: [] for s in SHAPES} for t in targets}
    loads = []
    for _ in range(repeats):
        loads.append(load_average())
        for shape, plan in plans.items():
            for t, make in targets.items():
                shape_runs[t][shape].append(run_shape(make, plan))
    loads.append(load_average())
    return shape_runs, loads


def _shape_ratios(shapes: dict, reference: bool) -> dict:
    """Per ``target/shape`` of ours: queries/s against the engine in process and, with a reference server that
    answered, queries/s and p50 against it."""
    ratios: dict = {}
    for t in shapes:
        if t in ("inprocess", "reference"):
            continue
        for s in SHAPES:
            m = shapes[t][s]
            r = {"qps_vs_inprocess": m["qps"] / shapes["inprocess"][s]["qps"]}
            if reference and shapes["reference"][s]["qps"] > 0:
                ref = shapes["reference"][s]
                r["qps_vs_reference"] = m["qps"] / ref["qps"]
                r["p50_vs_reference"] = m["p50_ms"] / ref["p50_ms"]
            ratios[f"{t}/{s}"] = r
    return ratios


def bench_retriever(args) -> dict:
    """Batch-64 throughput vs in-process (the original keys), then the load shapes of :data:`SHAPES` against our
    gRPC and HTTP with security off and on (TLS + bearer token), the in-process engine and, with
    ``--reference-url``, an external Search-R1-compatible ``/retrieve`` server: qps, p50/p95 per request, medians of
    ``--repeats`` interleaved runs, and ratios ours / reference and ours / in-process."""
    from services.retriever.server import RetrieverConfig, open_engine  # faiss, the encoder: in-process only

    world, index, batch, iters, topk = args.world, args.index, args.batch, args.iters, 3
    secure = not getattr(args, "no_secure", False)
    reference = getattr(args, "reference_url", "") or ""
    n_single = max(10, getattr(args, "shape_requests", 0) or 200)

    ensure_indexes(world)
    pool = _query_pool(world)
    batches, small = _batches(pool, batch, iters)
    plans = {name: shape_plan(pool, c, per, _shape_requests(c, per, n_single)) for name, (c, per) in SHAPES.items()}
    engine = open_engine(RetrieverConfig(world=world))
    servers = _start_servers(world, index, secure, Path(tempfile.mkdtemp(prefix="bench-retriever-")))
    try:
        runs = _batch_throughput(engine, servers[""], batches, small, topk, index, args.repeats)
        shape_runs, loads = _run_shapes(_shape_targets(engine, servers, topk, index, reference), plans, args.repeats)
    finally:
        stop(*(srv.proc for srv in servers.values()))

    med = {k: median_dicts(v) for k, v in runs.items()}
    shapes = {t: {s: {**median_dicts(v), "runs": v} for s, v in by.items()} for t, by in shape_runs.items()}
    ratios = _shape_ratios(shapes, bool(reference))
    goal_met = None
    if reference:
        goal_met = all(r["qps_vs_reference"] >= 1.0 for r in ratios.values() if "qps_vs_reference" in r)
    return {
        "target": "retriever",
        "index": index,
        "batch": batch,
        "iters": iters,
        "repeats": args.repeats,
        "num_documents": len(engine.docstore),
        "machine": machine(),
        **med,
        "ratio": med["grpc"]["qps"] / med["inprocess"]["qps"],
        "http_ratio": med["http"]["qps"] / med["inprocess"]["qps"],
        "concurrent_vs_inprocess_batch8_ratio": med["grpc_concurrent_8x8"]["qps"] / med["inprocess_8"]["qps"],
        "goal": "ratio >= 0.8 at batch 64",
        "shapes": shapes,
        "shape_ratios": ratios,
        "shape_requests": {s: sum(len(r) for r in plans[s]) for s in SHAPES},
        "reference_url": reference,
        "secure": "TLS + bearer token" if secure else "off",
        "load_average": loads,
        "shapes_goal": "qps_vs_reference >= 1 for every target and shape (with --reference-url)",
        "shapes_goal_met": goal_met,
    }
