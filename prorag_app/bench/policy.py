"""`prorag bench policy`: GRPO-sized rollouts through the policy service against the same engine in process,
with the decode limits of :mod:`prorag_app.bench.decode`."""

from __future__ import annotations

import time

from prorag import paths
from prorag.rpc.clients import wait_for_health
from prorag_app.bench.decode import bench_adapter_decode, bench_decode
from prorag_app.bench.harness import free_port, median_dicts, serve, stop
from prorag_app.bench.models import bench_model


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
    model = bench_model(world, args.model)
    questions = load_split(paths.world_dir(world), "test")[:args.questions]
    qs = [(q.id, q.question) for q in questions]
    n, max_tokens, seed = args.samples, 64, 1234
    retr_engine = open_engine(RetrieverConfig(world=world))

    def search(queries, k):
        return retr_engine.search(queries, k)

    engine = TransformersEngine(model, max_batch_size=512)
    spec = SamplingSpec(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed)
    rport, pport = free_port(paths.GRPC_PORTS["retriever"] + 1100), free_port(paths.GRPC_PORTS["policy"] + 1100)
    retr = serve("retriever", rport, {"world": world})
    # restore_active off: a replica otherwise comes up serving the adapter last activated for this model (an RL
    # run's), and the comparison would be a LoRA-wrapped policy against the bare one in process
    pol = serve("policy", pport, {"world": world, "model": model, "retriever": f"127.0.0.1:{rport}",
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
        stop(pol, retr)
    med = {k: median_dicts(v) for k, v in runs.items()}
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
