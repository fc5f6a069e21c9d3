"""`prorag bench prm`: steps scored per second through the PRM service, in process, and one call per step."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from prorag import paths
from prorag.data.loaders import load_corpus, load_split
from prorag.rpc.clients import PRMClient, wait_for_health
from prorag_app.bench.harness import free_ports, machine, median_dicts, serve, stop
from prorag_app.bench.models import bench_prm_model
from prorag_app.embedded import ensure_indexes


def bench_prm(args) -> dict:
    """Steps scored per second: whole gold trajectories through the PRM service (``clients`` callers at once,
    ``batch`` trajectories per call) against the same engine in process, and against the reference code's way,
    one call per step on its own prefix; same model, same steps, same run."""
    import torch

    from prorag_app.profiles import PROFILES
    from prorag_app.eval import gold_trajectories
    from services.prm.engine import PRMEngine, ScoringItem

    ensure_indexes(args.world)
    prm_dir = bench_prm_model(args.world, args.model if args.model != "sft" else "prm")
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

    [port] = free_ports()
    with tempfile.TemporaryDirectory() as logs:
        proc = serve("prm", port, {"model": prm_dir, "world": args.world}, Path(logs) / "prm.log")
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
            stop(proc)
    med = median_dicts(runs)
    return {"target": "prm", "model": prm_dir, "trajectories": len(items), "steps": n_steps, "batch": args.batch,
            "clients": args.clients, "repeats": args.repeats, "threads": torch.get_num_threads(), "machine": machine(),
            **med, "service_vs_inprocess": med["service_steps_per_s"] / med["inprocess_steps_per_s"],
            "service_vs_per_prefix": med["service_steps_per_s"] / med["per_prefix_steps_per_s"],
            "goals": {"service_vs_inprocess": 0.8, "service_vs_per_prefix": 10.0}, "runs": runs}
