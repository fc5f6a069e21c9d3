"""`prorag bench swap`: adapter pushes to the policy service while clients keep generating."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from prorag.registry import ArtifactRef, Registry, weights_sha256
from prorag.rpc.clients import PolicyClient, wait_for_health
from prorag_app.bench.harness import free_ports, percentile, serve, stop
from prorag_app.bench.models import bench_model, random_lora


def bench_swap(args) -> dict:
    """100 adapter pushes (load new version + activate + unload the old one) under concurrent generation."""
    world = args.world
    model = bench_model(world, args.model)
    root = Path(tempfile.mkdtemp(prefix="swap-adapters-"))
    peft_model, _ = random_lora(model)
    src = root / "src"
    peft_model.save_pretrained(src)
    sha = weights_sha256(model)
    swaps = args.swaps
    adapters = Registry(root / "adapters", "adapter")
    for i in range(swaps + 1):
        adapters.publish(src, ArtifactRef("bench", f"v{i}"), base_model=model, base_model_sha256=sha, step=i)
    [port] = free_ports()
    pol = serve("policy", port, {"world": world, "model": model, "adapter_root": str(root / "adapters")})
    target = f"127.0.0.1:{port}"
    lat, failed, ok, versions = [], [], [0], set()
    stop_load = threading.Event()
    try:
        if not wait_for_health(target, "prorag.v1.Policy", timeout=300):
            raise SystemExit("policy did not start for the benchmark")
        with PolicyClient(target, timeout=120) as c:
            c.load_adapter("bench", "v0")
            c.activate_adapter("bench", "v0")

        def load_loop():
            with PolicyClient(target, timeout=120) as c:
                while not stop_load.is_set():
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
        stop_load.set()
        for t in threads:
            t.join(60)
    finally:
        stop_load.set()
        stop(pol)
    return {"target": "swap", "model": model, "swaps": swaps, "clients": args.clients,
            "swap_p50_s": percentile(lat, 0.5), "swap_p95_s": percentile(lat, 0.95), "swap_max_s": max(lat),
            "failed_requests": len(failed), "ok_requests": ok[0],
            "versions_seen": len(versions), "errors_sample": failed[:3],
            "goal": "swap_p50_s < 0.5, failed_requests == 0"}
