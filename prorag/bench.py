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
from prorag.clients import RetrieverClient, wait_for_health
from prorag.stack import port_free

TARGETS = ("retriever",)


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


def bench_retriever(args) -> dict:
    from prorag.data.loaders import load_split
    from prorag.embedded import ensure_indexes
    from services.retriever.server import RetrieverConfig, open_engine

    world = args.world
    ensure_indexes(world)
    questions = load_split(paths.world_dir(world), "test")
    pool = [s.question for q in questions for s in q.decomposition] or [q.question for q in questions]
    batch, iters, topk, index = args.batch, args.iters, 3, args.index
    batches = [[pool[(i * batch + j) % len(pool)] for j in range(batch)] for i in range(iters)]
    small = [[q] for b in batches[: max(4, iters // 4)] for q in b[:8]]  # batch-8 slices for the concurrency run
    small = [sum(small[i:i + 8], []) for i in range(0, len(small), 8)]

    engine = open_engine(RetrieverConfig(world=world))
    grpc_port, http_port = _free_port(paths.GRPC_PORTS["retriever"] + 1000), _free_port(paths.HTTP_PORTS["retriever"] + 1000)
    proc = subprocess.Popen([sys.executable, "-m", "prorag.cli", "serve", "retriever", "--port", str(grpc_port),
                             "--http-port", str(http_port), "--set", f"world={world}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        if not wait_for_health(f"127.0.0.1:{grpc_port}", "prorag.v1.Retriever", timeout=180):
            raise SystemExit("retriever server did not start for the benchmark")
        client = RetrieverClient(f"127.0.0.1:{grpc_port}", timeout=120)
        url = f"http://127.0.0.1:{http_port}/retrieve"

        def http_call(qs):
            req = urllib.request.Request(url, data=json.dumps({"queries": qs, "topk": topk, "return_scores": True})
                                         .encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                body = json.loads(r.read())
            assert len(body["result"]) == len(qs)

        runs = {"inprocess": [], "grpc": [], "http": [], "grpc_concurrent_8x8": [], "inprocess_8": []}
        for _ in range(args.repeats):
            # Interleaved so drift (thermal, other load) hits every path alike.
            runs["inprocess"].append(_time_calls(lambda qs: engine.search(qs, topk, index), batches))
            runs["grpc"].append(_time_calls(lambda qs: client.search(qs, topk, index), batches))
            runs["http"].append(_time_calls(http_call, batches))
            runs["inprocess_8"].append(_time_calls(lambda qs: engine.search(qs, topk, index), small))
            runs["grpc_concurrent_8x8"].append(_concurrent(lambda qs: client.search(qs, topk, index), small, 8))
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    med = {k: _median_dicts(v) for k, v in runs.items()}
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
    }
