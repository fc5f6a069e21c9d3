"""`prorag bench <target> --json`: measured, never assumed.

Every figure is compared in the same run against the in-process limit (the same engine
called directly, no network) and reported as a ratio. Each measurement is repeated and
the median kept. The last output line is one JSON object.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from prorag import paths
from prorag.rpc.clients import RetrieverClient, wait_for_health
from prorag_app import procs
from prorag_app.stack import port_free

TARGETS = ("retriever", "policy", "swap", "sft", "prm", "rl")


def _free_port(start: int) -> int:
    port = start
    while not port_free("127.0.0.1", port):
        port += 1
    return port


def _time_calls(fn, batches, warmup: int = 3) -> dict:
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
    lat.sort()
    return {"qps": n_queries / wall, "batch_latency_p50_s": lat[len(lat) // 2],
            "batch_latency_p95_s": lat[min(len(lat) - 1, int(len(lat) * 0.95))]}


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


def _median_dicts(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# ---------------------------------------------------------------- retriever load shapes
#: name -> (concurrent clients, queries per request): Search-R1's rollout callers (one question at a time),
#: many of them at once, and a whole rollout batch in one request
SHAPES = {"1x1": (1, 1), "16x1": (16, 1), "1x64": (1, 64)}


def _shape_plan(pool: list[str], clients: int, per_req: int, n_requests: int) -> list[list[list[str]]]:
    """Per client, its list of requests (each a list of queries), drawn round-robin from ``pool``."""
    plan, i = [], 0
    for _ in range(clients):
        reqs = []
        for _ in range(n_requests):
            reqs.append([pool[(i + j) % len(pool)] for j in range(per_req)])
            i += per_req
        plan.append(reqs)
    return plan


def _pct(lat: list[float], q: float) -> float:
    s = sorted(lat)
    return s[min(len(s) - 1, int(len(s) * q))]


def _run_shape(make_caller, plan: list[list[list[str]]], warmup: int = 3) -> dict:
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
    return {"qps": queries / wall, "p50_ms": 1e3 * _pct(lat, 0.5), "p95_ms": 1e3 * _pct(lat, 0.95),
            "errors": len(errors)}


class _HttpCaller:
    """One keep-alive HTTP(S) connection posting Search-R1's ``/retrieve`` body; checks the answer's shape."""

    def __init__(self, url: str, topk: int, security=None):
        import http.client
        import ssl
        import urllib.parse

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


class _GrpcCaller:
    """One channel calling prorag.v1.Retriever/Search, documents converted as RetrieverClient does."""

    def __init__(self, target: str, topk: int, index: str, security=None):
        from prorag.rpc.clients import channel
        from prorag.pb import retriever_pb2, retriever_pb2_grpc
        from prorag.rpc.pbconv import scored_document_from_pb

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


def _start_retriever(world: str, index: str, env_extra: dict | None = None, log_path=None) -> tuple:
    """``prorag serve retriever`` in its own process (its default index = ``index``): (proc, grpc port, http port)."""
    import os

    grpc_port = _free_port(paths.GRPC_PORTS["retriever"] + 1000)
    http_port = _free_port(paths.HTTP_PORTS["retriever"] + 1000)
    while http_port == grpc_port:
        http_port = _free_port(http_port + 1)
    env = dict(os.environ, **(env_extra or {}))
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # procs.spawn: stopped with the bench, even a killed one (a timeout's SIGTERM used to leave it serving)
    proc = procs.spawn([sys.executable, "-m", "prorag_app.cli", "serve", "retriever", "--port", str(grpc_port),
                        "--http-port", str(http_port), "--set", f"world={world}",
                        "--set", f"default_index={index}"],
                       stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, grpc_port, http_port


def _wait_serving(target: str, security, timeout: float = 180.0) -> bool:
    """grpc.health.v1 of the retriever over ``security`` (TLS servers need the CA even for health)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prorag.rpc.clients import channel

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


def _load_average() -> list[float]:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def bench_retriever(args) -> dict:
    """Batch-64 throughput vs in-process (the original keys), then the load shapes of :data:`SHAPES` against our
    gRPC and HTTP with security off and on (TLS + bearer token), the in-process engine and, with
    ``--reference-url``, an external Search-R1-compatible ``/retrieve`` server: qps, p50/p95 per request, medians of
    ``--repeats`` interleaved runs, and ratios ours / reference and ours / in-process."""
    import tempfile
    from pathlib import Path

    from prorag.data.loaders import load_split
    from prorag.rpc.security import ClientSecurity, generate_secrets
    from prorag_app.embedded import ensure_indexes
    from services.retriever.server import RetrieverConfig, open_engine

    world = args.world
    ensure_indexes(world)
    questions = load_split(paths.world_dir(world), "test")
    pool = [s.question for q in questions for s in q.decomposition] or [q.question for q in questions]
    batch, iters, topk, index = args.batch, args.iters, 3, args.index
    batches = [[pool[(i * batch + j) % len(pool)] for j in range(batch)] for i in range(iters)]
    small = [[q] for b in batches[: max(4, iters // 4)] for q in b[:8]]  # batch-8 slices for the concurrency run
    small = [sum(small[i:i + 8], []) for i in range(0, len(small), 8)]
    secure = not getattr(args, "no_secure", False)
    reference = getattr(args, "reference_url", "") or ""
    n_single = max(10, getattr(args, "shape_requests", 0) or 200)

    engine = open_engine(RetrieverConfig(world=world))
    tmp = Path(tempfile.mkdtemp(prefix="bench-retriever-"))
    plain_sec = ClientSecurity()
    servers = {"": _start_retriever(world, index, log_path=tmp / "plain.log")}
    if not _wait_serving(f"127.0.0.1:{servers[''][1]}", plain_sec):
        _stop(servers[""][0])
        raise SystemExit(f"retriever server did not start for the benchmark: {(tmp / 'plain.log').read_text()[-2000:]}")
    client_sec = {"": plain_sec}
    try:
        if secure:
            s = generate_secrets(tmp / "secrets")
            servers["_secure"] = _start_retriever(
                world, index, {"PRORAG_TLS_CERT": s["server_cert"], "PRORAG_TLS_KEY": s["server_key"],
                               "PRORAG_AUTH_TOKENS": s["tokens"]}, log_path=tmp / "secure.log")
            client_sec["_secure"] = ClientSecurity.from_env({"PRORAG_TLS_CA": s["ca"],
                                                             "PRORAG_TOKEN_FILE": s["token_client"],
                                                             "PRORAG_TLS_SERVER_NAME": "localhost"})
            if not _wait_serving(f"127.0.0.1:{servers['_secure'][1]}", client_sec["_secure"]):
                raise SystemExit("the TLS + token retriever did not start for the benchmark: "
                                 f"{(tmp / 'secure.log').read_text()[-2000:]}")
        _, grpc_port, http_port = servers[""]
        url = f"http://127.0.0.1:{http_port}/retrieve"
        grpc_call = _GrpcCaller(f"127.0.0.1:{grpc_port}", topk, index)
        http_call = _HttpCaller(url, topk)

        # The original figures: batch-``batch`` throughput of each path, and 8 gRPC clients x batch 8.
        runs = {"inprocess": [], "grpc": [], "http": [], "grpc_concurrent_8x8": [], "inprocess_8": []}
        for _ in range(args.repeats):
            # Interleaved so drift (thermal, other load) hits every path alike.
            runs["inprocess"].append(_time_calls(lambda qs: engine.search(qs, topk, index), batches))
            runs["grpc"].append(_time_calls(grpc_call, batches))
            runs["http"].append(_time_calls(http_call, batches))
            runs["inprocess_8"].append(_time_calls(lambda qs: engine.search(qs, topk, index), small))
            runs["grpc_concurrent_8x8"].append(_concurrent(grpc_call, small, 8))
        grpc_call.close()
        http_call.close()

        # The load shapes, per target; targets interleaved within every repeat.
        targets = {"inprocess": lambda: (lambda qs: engine.search(qs, topk, index))}
        for suffix, (_, gp, hp) in servers.items():
            sec = client_sec[suffix]
            scheme = "https" if suffix else "http"
            targets["grpc" + suffix] = (lambda gp=gp, sec=sec: _GrpcCaller(f"127.0.0.1:{gp}", topk, index, sec))
            targets["http" + suffix] = (lambda hp=hp, sec=sec, scheme=scheme:
                                        _HttpCaller(f"{scheme}://127.0.0.1:{hp}/retrieve", topk, sec))
        if reference:
            targets["reference"] = lambda: _HttpCaller(reference, topk)
        plans = {name: _shape_plan(pool, c, per, n if per == 1 and c == 1 else
                                   (max(5, 2 * n // c) if per == 1 else max(5, n // 20)))
                 for name, (c, per) in SHAPES.items() for n in [n_single]}
        shape_runs: dict = {t: {s: [] for s in SHAPES} for t in targets}
        loads = []
        for _ in range(args.repeats):
            loads.append(_load_average())
            for shape, plan in plans.items():
                for t, make in targets.items():
                    shape_runs[t][shape].append(_run_shape(make, plan))
        loads.append(_load_average())
    finally:
        _stop(*(p for p, _, _ in servers.values()))
    med = {k: _median_dicts(v) for k, v in runs.items()}
    shapes = {t: {s: {**_median_dicts(v), "runs": v} for s, v in by.items()} for t, by in shape_runs.items()}
    ratios: dict = {}
    for t in targets:
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
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}".strip(),
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


def _serve(service: str, port: int, sets: dict, log_path=None, extra_args=()) -> subprocess.Popen:
    """``prorag serve <service>`` on ``port`` (no HTTP) with ``--set`` ``sets`` and any ``extra_args`` (serve flags
    such as ``--max-concurrent-rpcs``, ``--metrics-port``)."""
    cmd = [sys.executable, "-m", "prorag_app.cli", "serve", service, "--port", str(port), "--http-port", "-1",
           *extra_args]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return procs.spawn(cmd, stdout=out, stderr=subprocess.STDOUT)  # stopped with the bench, even a killed one


def _stop(*started) -> None:
    procs.stop(started)  # SIGTERM, then SIGKILL after procs.STOP_TIMEOUT_S; reaped


def _bench_model(world: str, model: str) -> str:
    """The model to benchmark: a path, a published name (sft -> newest sft), or the embedded base."""
    from prorag_app.embedded import ensure_policy_model
    from prorag.errors import NotFound
    from prorag.registry import registry

    if model == "base":
        return str(ensure_policy_model(world))
    try:
        return str(registry("model", world).resolve(model))
    except NotFound:
        if model != "sft":
            raise
        return str(ensure_policy_model(world))  # nothing trained yet: the base model


def bare_decode_tokens_per_s(model, prompts: list[list[int]], new_tokens: int, pad_id: int, seed: int = 0) -> float:
    """The limit an engine's decoding reaches on this machine: the same model's batched forward passes alone
    (left-padded prefill of each distinct prompt once, its cache copied to the rows that share it, then
    ``new_tokens`` one-token steps for every row with a DynamicCache and plain multinomial sampling at temperature
    1: no stops, no per-sequence bookkeeping). Generated tokens per second, prefill included, as the engine's figure
    is. Every row decodes all ``new_tokens``, while an engine drops rows that stopped, so an engine whose samples
    stop early can beat this figure per token generated."""
    import torch
    from transformers import DynamicCache

    B = len(prompts)
    device = next(model.parameters()).device
    uniq = list(dict.fromkeys(tuple(p) for p in prompts))  # each distinct prompt prefilled once, as an engine does
    where = {p: i for i, p in enumerate(uniq)}
    expand = torch.tensor([where[tuple(p)] for p in prompts], dtype=torch.long, device=device)
    L = max(len(p) for p in uniq)
    ids = torch.full((len(uniq), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(uniq), L), dtype=torch.long)
    for i, p in enumerate(uniq):
        ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    g = torch.Generator(device).manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1, :].float()
        cache.reorder_cache(expand)
        logits, attn, next_pos = logits[expand], attn[expand], pos[expand, -1] + 1
        for _ in range(new_tokens):
            tok = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)  # [B, 1]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
            logits = model(input_ids=tok, attention_mask=attn, position_ids=next_pos[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1, :].float()
            next_pos = next_pos + 1
    sync()
    return B * new_tokens / (time.perf_counter() - t0)


def bench_decode(engine, questions, batch: int, new_tokens: int, repeats: int) -> dict:
    """The engine's decode tokens/s against the bare batched forward pass of the same model at the same batch
    size (bare_decode_tokens_per_s), on ``batch`` first-step prompts of the test questions; medians."""
    from prorag.engine import SamplingSpec
    from prorag.trajectory import render_prompt

    # a GRPO batch decodes G samples of each prompt: the same prompts repeated, as the rollout's first step does
    base = [engine.tokenizer.encode(render_prompt(q.question), add_special_tokens=False) for q in questions]
    prompts = [base[i % len(base)] for i in range(batch)]
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, seed=99)
    eng, bare = [], []
    for _ in range(repeats):
        engine.prefix_cache.clear()  # both sides prefill every prompt
        t0 = time.perf_counter()
        out = engine.generate(prompts, spec)
        eng.append(sum(len(s[0].token_ids) for s in out) / (time.perf_counter() - t0))
        bare.append(bare_decode_tokens_per_s(engine.base, prompts, new_tokens, engine.pad_id))
    e, b = statistics.median(eng), statistics.median(bare)
    return {"batch": len(prompts), "new_tokens": new_tokens, "engine_tokens_per_s": e,
            "bare_forward_tokens_per_s": b, "ratio": e / b}


def _random_lora(model: str):
    """(``model`` with an RL-shaped LoRA: r16, alpha 32, every linear projection, B drawn so it changes the
    outputs, its tokenizer)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from prorag.modeling import load_policy

    m, tok = load_policy(model)
    peft_model = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return peft_model, tok


def bench_adapter_decode(model: str, questions, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decoding with an RL-shaped adapter (LoRA r16, alpha 32, every linear projection, random B) as PEFT's LoRA
    layers on the base against a merged copy (the policy's default, merge_adapters) and the bare base, on the same
    first-step prompts; medians of interleaved runs."""
    import tempfile

    from prorag.engine import SamplingSpec
    from prorag.trajectory import render_prompt
    from services.policy.engine import TransformersEngine

    peft_model, tok = _random_lora(model)
    adapter_dir = tempfile.mkdtemp(prefix="bench-adapter-")
    peft_model.save_pretrained(adapter_dir)
    engines = {"peft_layers": TransformersEngine(model, max_batch_size=512, merge_adapters=False),
               "merged": TransformersEngine(model, max_batch_size=512, merge_adapters=True),
               "base": TransformersEngine(model, max_batch_size=512)}
    for name in ("peft_layers", "merged"):
        engines[name].load_adapter("bench", adapter_dir)
    firsts = [tok.encode(render_prompt(q.question), add_special_tokens=False) for q in questions]
    prompts = [firsts[i % len(firsts)] for i in range(batch)]
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, seed=99)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.prefix_cache.clear()
            t0 = time.perf_counter()
            out = engine.generate(prompts, spec, adapter=None if name == "base" else "bench")
            rates[name].append(sum(len(s[0].token_ids) for s in out) / (time.perf_counter() - t0))
    med = {f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()}
    return {"batch": batch, "new_tokens": new_tokens, **med,
            "merged_vs_peft_layers": med["merged_tokens_per_s"] / med["peft_layers_tokens_per_s"],
            "merged_vs_base": med["merged_tokens_per_s"] / med["base_tokens_per_s"]}


def bench_policy(args) -> dict:
    """GRPO-sized rollouts (questions x samples) through the policy service vs the same engine in-process."""
    from prorag.rpc.clients import PolicyClient
    from prorag.data.loaders import load_split
    from prorag_app.embedded import ensure_indexes
    from prorag.engine import SamplingSpec
    from services.policy.engine import TransformersEngine
    from prorag.rollout import run_rollouts
    from services.retriever.server import RetrieverConfig, open_engine

    world = args.world
    ensure_indexes(world)
    model = _bench_model(world, args.model)
    questions = load_split(paths.world_dir(world), "test")[:args.questions]
    qs = [(q.id, q.question) for q in questions]
    n, max_tokens, seed = args.samples, 64, 1234
    retr_engine = open_engine(RetrieverConfig(world=world))

    def search(queries, k):
        return retr_engine.search(queries, k)

    engine = TransformersEngine(model, max_batch_size=512)
    spec = SamplingSpec(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed)
    rport, pport = _free_port(paths.GRPC_PORTS["retriever"] + 1100), _free_port(paths.GRPC_PORTS["policy"] + 1100)
    retr = _serve("retriever", rport, {"world": world})
    # restore_active off: a replica otherwise comes up serving the adapter last activated for this model (an RL
    # run's), and the comparison would be a LoRA-wrapped policy against the bare one in process
    pol = _serve("policy", pport, {"world": world, "model": model, "retriever": f"127.0.0.1:{rport}",
                                   "max_n": max(64, n), "max_batch_size": 512, "restore_active": "false"})
    runs = {"inprocess": [], "service": [], "inprocess_no_search_cache": []}
    try:
        for target, svc in ((f"127.0.0.1:{rport}", "prorag.v1.Retriever"), (f"127.0.0.1:{pport}", "prorag.v1.Policy")):
            if not wait_for_health(target, svc, timeout=300):
                raise SystemExit(f"{svc} did not start for the benchmark")
        client = PolicyClient(f"127.0.0.1:{pport}", timeout=3600)
        for _ in range(args.repeats):
            for key, cache in (("inprocess", True), ("inprocess_no_search_cache", False)):
                searches: dict = {}
                t0 = time.perf_counter()
                res = run_rollouts(engine, engine.tokenizer, qs, spec, search, max_steps=13, search_cache=cache,
                                   stats=searches)
                wall = time.perf_counter() - t0
                runs[key].append({"trajectories_per_s": len(res) / wall, "wall_s": wall,
                                  "generated_tokens_per_s": sum(r.tokens.generated_tokens for r in res) / wall,
                                  "mean_steps": sum(len(r.steps) for r in res) / len(res),
                                  "search_cache_hit_rate": (1 - searches["searches_made"] / searches["searches_asked"]
                                                            if searches["searches_asked"] else 0.0)})
            t0 = time.perf_counter()
            trajs = [t for t in client.rollout(qs, client.sampling(n=n, temperature=1.0, max_tokens=max_tokens,
                                                                   seed=seed), max_steps=13)
                     if hasattr(t, "question_id")]
            wall = time.perf_counter() - t0
            runs["service"].append({"trajectories_per_s": len(trajs) / wall, "wall_s": wall,
                                    "generated_tokens_per_s": sum(sum(t.trace.generated_mask) for t in trajs) / wall,
                                    "mean_steps": sum(len(t.steps) for t in trajs) / max(1, len(trajs))})
        client.close()
    finally:
        _stop(pol, retr)
    med = {k: _median_dicts(v) for k, v in runs.items()}
    decode = bench_decode(engine, questions, batch=len(qs) * n, new_tokens=max_tokens, repeats=args.repeats)
    adapter_decode = bench_adapter_decode(model, questions, batch=len(qs) * n, new_tokens=max_tokens,
                                          repeats=args.repeats)
    return {"target": "policy", "model": model, "questions": len(qs), "samples": n, "repeats": args.repeats,
            **med, "decode_vs_bare_forward": decode, "adapter_decode": adapter_decode,
            "ratio": med["service"]["trajectories_per_s"] / med["inprocess"]["trajectories_per_s"],
            "tokens_ratio": med["service"]["generated_tokens_per_s"] / med["inprocess"]["generated_tokens_per_s"],
            "search_cache_hit_rate": med["inprocess"]["search_cache_hit_rate"],
            "search_cache_speedup": med["inprocess"]["trajectories_per_s"]
            / med["inprocess_no_search_cache"]["trajectories_per_s"],
            "goal": "ratio >= 0.9 (issue 19)"}


def bench_swap(args) -> dict:
    """100 adapter pushes (load new version + activate + unload the old one) under concurrent generation."""
    import tempfile
    from pathlib import Path

    from prorag.rpc.clients import PolicyClient
    from prorag.registry import ArtifactRef, Registry, weights_sha256

    world = args.world
    model = _bench_model(world, args.model)
    root = Path(tempfile.mkdtemp(prefix="swap-adapters-"))
    peft_model, _ = _random_lora(model)
    src = root / "src"
    peft_model.save_pretrained(src)
    sha = weights_sha256(model)
    swaps = args.swaps
    adapters = Registry(root / "adapters", "adapter")
    for i in range(swaps + 1):
        adapters.publish(src, ArtifactRef("bench", f"v{i}"), base_model=model, base_model_sha256=sha, step=i)
    port = _free_port(paths.GRPC_PORTS["policy"] + 1200)
    pol = _serve("policy", port, {"world": world, "model": model, "adapter_root": str(root / "adapters")})
    target = f"127.0.0.1:{port}"
    lat, failed, ok, versions = [], [], [0], set()
    stop = threading.Event()
    try:
        if not wait_for_health(target, "prorag.v1.Policy", timeout=300):
            raise SystemExit("policy did not start for the benchmark")
        with PolicyClient(target, timeout=120) as c:
            c.load_adapter("bench", "v0")
            c.activate_adapter("bench", "v0")

        def load_loop():
            with PolicyClient(target, timeout=120) as c:
                while not stop.is_set():
                    try:
                        r = c.generate_steps(["Where was the founder of the brewery born?"] * 4,
                                             c.sampling(n=2, temperature=1.0, max_tokens=16))
                        versions.add(r.adapter_version)
                        ok[0] += 1
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        failed.append(repr(e)[:200])

        threads = [threading.Thread(target=load_loop) for _ in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        with PolicyClient(target, timeout=120) as c:
            for i in range(1, swaps + 1):
                t0 = time.perf_counter()
                c.load_adapter("bench", f"v{i}")
                c.activate_adapter("bench", f"v{i}")
                lat.append(time.perf_counter() - t0)
                c.unload_adapter("bench", f"v{i - 1}")
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        _stop(pol)
    lat.sort()
    return {"target": "swap", "model": model, "swaps": swaps, "clients": args.clients,
            "swap_p50_s": lat[len(lat) // 2], "swap_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "swap_max_s": lat[-1], "failed_requests": len(failed), "ok_requests": ok[0],
            "versions_seen": len(versions), "errors_sample": failed[:3], "goal": "swap_p50_s < 0.5, failed_requests == 0"}


#: share of an SFT sequence's positions that are trained (about a fifth of an agent trajectory: prompt, documents
#: and glue are masked), so the LM head runs on as many positions as in the sft stage
SFT_TRAINED_SHARE = 0.2


def bench_sft(args) -> dict:
    """SFT optimizer steps of a policy through the one training loop with the sft stage's loss, on synthetic
    sequences (batch x seq_len random ordinary tokens, a fifth of them trained): tokens/s and MFU against the
    measured peak matmul FLOP/s of the dtype used (--device / --dtype / --compile, as a stage's config takes them;
    auto = the first GPU in bf16, else the CPU in float32). Per repeat the first logging window (allocation,
    warm-up) is dropped."""
    import os
    import tempfile

    import torch

    from prorag.modeling import load_for_training, load_policy, num_parameters
    from prorag.training.devices import resolve
    from prorag.training.run_config import TrainRunConfig
    from prorag.training.context import local_context
    from prorag.training.flops import peak_matmul_flops
    from prorag.training.lm import weighted_lm_loss
    from prorag.training.loop import LoopConfig, run_loop
    from prorag.trajectory import CHAT_TOKENS, TAGS

    placement = resolve(TrainRunConfig(device=args.device, dtype=args.dtype))
    model_dir = _bench_model(args.world, args.model)
    vocab = len(load_policy(model_dir)[1])
    batch, seq_len, window = args.batch, args.seq_len, max(1, args.iters // 3)

    def batch_at(i: int):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(len(CHAT_TOKENS) + len(TAGS), vocab, (batch, seq_len), generator=g)
        trained = torch.rand(batch, seq_len, generator=g) < SFT_TRAINED_SHARE
        return ids, torch.ones_like(ids), ids.masked_fill(~trained, -100), trained.float()

    def loss_fn(m, b):
        ids, attn, labels, w = b
        return weighted_lm_loss(m, ids, attn, labels, w)[0], int(attn.sum())

    cfg = LoopConfig(steps=3 * window, optimizer="adamw", lr=1e-4, weight_decay=0.01, grad_clip=1.0,
                     checkpoint_every=3 * window, log_every=window, compile=args.compile)
    runs = []
    for _ in range(args.repeats):
        model = load_for_training(model_dir, placement)[0]  # fresh weights and optimizer for every repeat
        events: list[dict] = []
        with tempfile.TemporaryDirectory() as work:
            run_loop(local_context(work, cfg, emit=events.append), model, batch_at, loss_fn, cfg, placement=placement)
        later = [e for e in events if e.get("loss") is not None][1:]
        runs.append({"tokens_per_s": statistics.median(e["tokens_per_s"] for e in later),
                     "mfu": statistics.median(e["metrics"]["mfu"] for e in later)})
    return {"target": "sft", "model": model_dir, "num_parameters": num_parameters(model), "batch": batch,
            "seq_len": seq_len, "steps_per_repeat": 3 * window, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "peak_matmul_flops": peak_matmul_flops(placement.device, placement.dtype),
            **placement.describe(), "compile": args.compile,
            "machine": f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}".strip(),
            **_median_dicts(runs), "runs": runs}


def _trajectory_lengths(tokenizer, limit: int = 500) -> list[int]:
    """Token lengths of the agent's greedy test trajectories that the last `prorag run` saved (prompt
    included); empty when there are none."""
    from prorag import paths
    from prorag.data.sft import agent_prompt

    path = paths.runs_dir() / "latest" / "sft" / "predictions.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines()[:limit]:
        r = json.loads(line)
        text = agent_prompt(r["question"]) + (r.get("trajectory") or {}).get("text", "")
        out.append(len(tokenizer.encode(text, add_special_tokens=False)))
    return out


#: the parts of one RL iteration, as the RL stage's summary names their medians (prorag_app.stage34.rl_summary)
RL_STEP_PARTS = ("rollout", "prm_scoring", "reward", "update", "adapter_sync")


def rl_step_split(results: dict) -> dict:
    """Per RL method of a run's results.json: the median seconds of each part of an iteration (RL_STEP_PARTS) and
    each part's share of their sum; {} when the run trained no RL method."""
    out = {}
    for method, summary in (((results.get("stage34") or {}).get("rl")) or {}).items():
        parts = {p: float(summary.get(f"median_{p}_s", 0.0)) for p in RL_STEP_PARTS}
        total = sum(parts.values())
        out[method] = {**{f"{p}_s": v for p, v in parts.items()}, "iteration_s": total,
                       **{f"{p}_share": (v / total if total else 0.0) for p, v in parts.items()}}
    return out


def bench_rl(args) -> dict:
    """One RL update (the clipped loss's forward and backward through a LoRA policy) over a GRPO iteration's
    trajectories (--questions x --samples): one padded pass against length-sorted chunks of at most the stage's
    chunk_tokens padded tokens (prorag.training.lora.length_chunks; the same gradient). Lengths are drawn from
    the agent's saved test trajectories (uniform 200-1,000 tokens without them); token ids are random. Also the
    last `prorag run`'s RL iterations split into rollout, PRM scoring, reward, update and adapter sync
    (rl_step_split)."""
    import random

    import torch

    from prorag.config import from_dict
    from prorag.modeling import load_policy
    from prorag.training.lora import RLSample, build_lora, collate_rl, length_chunks, rl_loss
    from services.trainer.stage_rl import RLConfig

    model_dir = _bench_model(args.world, args.model)
    model, tok = load_policy(model_dir)
    cfg = from_dict(RLConfig, {"base_model": model_dir})
    model = build_lora(model, cfg)
    pool = _trajectory_lengths(tok)
    rng = random.Random(0)
    n = args.questions * args.samples
    lengths = [rng.choice(pool) if pool else rng.randint(200, 1000) for _ in range(n)]
    samples = []
    for length in lengths:
        gen = [0] * 60 + [int(rng.random() < 0.5) for _ in range(length - 60)]
        samples.append(RLSample([rng.randrange(100, len(tok) - 1) for _ in range(length)], gen,
                                [rng.uniform(-1, 1) * g for g in gen], [float(g) for g in gen],
                                [-1.0 * g for g in gen]))

    def update(chunks) -> float:
        t = time.perf_counter()
        model.zero_grad()
        results = [rl_loss(model, collate_rl([samples[i] for i in c], tok.pad_token_id), cfg) for c in chunks]
        total = sum(st["tokens"] for _, st in results)
        sum(l * (st["tokens"] / total) for l, st in results).backward()
        return time.perf_counter() - t

    plans = {"one_pass": length_chunks(lengths, 0), "chunked": length_chunks(lengths, cfg.chunk_tokens)}
    out = {}
    for name, chunks in plans.items():
        times = [update(chunks) for _ in range(args.repeats)]
        out[name] = {"s": statistics.median(times), "chunks": len(chunks),
                     "padded_tokens": sum(len(c) * max(lengths[i] for i in c) for c in chunks)}
    from prorag import paths

    latest = paths.runs_dir() / "latest" / "results.json"
    # where an iteration's time goes in the real RL jobs of the last `prorag run` (medians over their iterations)
    split = rl_step_split(json.loads(latest.read_text())) if latest.is_file() else {}
    return {"target": "rl", "model": model_dir, "trajectories": n, "tokens": sum(lengths),
            "step_split": split, "step_split_from": str(latest) if split else None,
            "lengths_from": "saved agent trajectories" if pool else "uniform 200-1000",
            "chunk_tokens": cfg.chunk_tokens, "threads": torch.get_num_threads(), "repeats": args.repeats, **out,
            "ratio": out["one_pass"]["s"] / out["chunked"]["s"]}


def _bench_prm_model(world: str, model: str) -> str:
    """A published PRM (name[@version] or path); with none published, a PRM freshly made from the world's
    policy (same shape and cost: the benchmark measures speed, not judgement)."""
    import tempfile
    from pathlib import Path

    from prorag.errors import NotFound
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from prorag.registry import registry

    try:
        return str(registry("prm", world).resolve(model))
    except NotFound:
        if model != "prm":
            raise
    out = Path(tempfile.mkdtemp(prefix="bench-prm-")) / "prm"
    prm, tok = prm_from_policy(_bench_model(world, "sft"), seed=0)
    save_pretrained(prm, tok, out)
    return str(out)


def bench_prm(args) -> dict:
    """Steps scored per second: whole gold trajectories through the PRM service (``clients`` callers at once,
    ``batch`` trajectories per call) against the same engine in process, and against the reference code's way,
    one call per step on its own prefix; same model, same steps, same run."""
    import os
    import tempfile
    from pathlib import Path

    from prorag.rpc.clients import PRMClient
    from prorag.data.loaders import load_corpus, load_split
    from prorag_app.embedded import ensure_indexes
    from prorag_app.pipeline import PROFILES
    from prorag_app.stage2 import gold_trajectories
    from services.prm.engine import PRMEngine, ScoringItem

    ensure_indexes(args.world)
    prm_dir = _bench_prm_model(args.world, args.model if args.model != "sft" else "prm")
    world_dir = paths.world_dir(args.world)
    qs = [q for q in load_split(world_dir, "test") if any(s.doc_id for s in q.decomposition)][:args.questions]
    docs = {d.id: d for d in load_corpus(world_dir / "corpus.jsonl")}
    trajs = gold_trajectories(qs, docs, PROFILES["default"].sft_for("sft"))
    items = [ScoringItem(q.question, steps) for q, steps in zip(qs, trajs)]
    n_steps = sum(len(it.steps) for it in items)
    batches = [items[i:i + args.batch] for i in range(0, len(items), args.batch)]
    engine = PRMEngine(prm_dir)
    engine.score(batches[0][:2])  # warm-up

    def inprocess() -> float:
        t = time.perf_counter()
        for b in batches:
            engine.score(b)
        return n_steps / (time.perf_counter() - t)

    def per_prefix() -> float:
        t = time.perf_counter()
        for it in items:
            for k in range(len(it.steps)):
                engine.score([ScoringItem(it.question, it.steps[:k + 1], last_step_only=True)])
        return n_steps / (time.perf_counter() - t)

    port = _free_port(59300)
    with tempfile.TemporaryDirectory() as logs:
        proc = _serve("prm", port, {"model": prm_dir, "world": args.world}, Path(logs) / "prm.log")
        try:
            if not wait_for_health(f"127.0.0.1:{port}", "prorag.v1.ProcessRewardModel", timeout=120):
                raise SystemExit(f"the PRM service did not start; log: {(Path(logs) / 'prm.log').read_text()[-2000:]}")
            clients = [PRMClient(f"127.0.0.1:{port}") for _ in range(args.clients)]
            clients[0].score([(items[0].question, items[0].steps, False)])

            def service() -> float:
                shares = [batches[i::args.clients] for i in range(args.clients)]
                errors: list[BaseException] = []

                def send(c, share):
                    try:
                        for b in share:
                            c.score([(it.question, it.steps, False) for it in b])
                    except BaseException as e:  # noqa: BLE001 - re-raised below
                        errors.append(e)

                t = time.perf_counter()
                threads = [threading.Thread(target=send, args=(c, sh)) for c, sh in zip(clients, shares)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                if errors:
                    raise errors[0]
                return n_steps / (time.perf_counter() - t)

            runs = []
            for _ in range(args.repeats):
                runs.append({"service_steps_per_s": service(), "inprocess_steps_per_s": inprocess(),
                             "per_prefix_steps_per_s": per_prefix()})
            for c in clients:
                c.close()
        finally:
            _stop(proc)
    med = _median_dicts(runs)
    return {"target": "prm", "model": prm_dir, "trajectories": len(items), "steps": n_steps, "batch": args.batch,
            "clients": args.clients, "repeats": args.repeats, "threads": torch_threads(),
            "machine": f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}".strip(),
            **med, "service_vs_inprocess": med["service_steps_per_s"] / med["inprocess_steps_per_s"],
            "service_vs_per_prefix": med["service_steps_per_s"] / med["per_prefix_steps_per_s"],
            "goals": {"service_vs_inprocess": 0.8, "service_vs_per_prefix": 10.0}, "runs": runs}


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
