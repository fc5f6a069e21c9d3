"""`prorag bench load --json` and `prorag bench soak --json` (issue 31 item 3): services under load, measured.

``load`` drives the retriever, the policy and the PRM, each started by the bench on free loopback ports (the harness
of :mod:`prorag_app.bench.harness`: ``serve``, ``free_ports``, ``stop``), at rising concurrency (1, 2, 4, ... up to
``--max-concurrency`` or the ``--levels`` given; ``--level-seconds`` each). Per level: calls, status codes,
throughput, p50/p99 latency, the largest batcher queue depth scraped from the service's /metrics, and the CPU
seconds the service and the callers used (items per server CPU-second: the service's cost per item apart from the
callers', which share the machine's cores). The highest
level with 0 errors is reported as held. Then past capacity: the service started again with
``--max-concurrent-rpcs`` set low (``--overload-rpcs``; the retriever's batcher queue too), driven by more callers
than that for ``--overload-seconds`` with the caller's deadline ``--deadline-s``. The goal: every call either
completes (within its deadline) or is refused with RESOURCE_EXHAUSTED; the queue stays bounded by the limit; the
process is alive and its health SERVING afterwards.

``soak`` puts one service under a steady load (``--clients`` callers) for ``--minutes`` and samples the process's
resident memory (VmRSS in /proc/<pid>/status) every ``--sample-s`` seconds: first, last and max RSS, and the
least-squares slope in MB/minute over the second half of the run (the first half holds allocator and cache
warm-up); ``flat`` when that slope is under ``--flat-mb-per-min``.

Nothing here asserts a timing; the last output line is one JSON object (`prorag bench ... --json`).
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from prorag.rpc.clients import channel, wait_for_health
from prorag_app.bench.harness import free_ports, load_average, machine, percentile, serve, stop
from prorag_app.bench.workloads import LOAD_SERVICES, BadAnswer, Workload, workload

HEALTH_NAMES = {"retriever": "prorag.v1.Retriever", "policy": "prorag.v1.Policy",
                "prm": "prorag.v1.ProcessRewardModel"}
#: what a caller may get past capacity: an answer (within its deadline) or a refusal to retry later
ALLOWED_PAST_CAPACITY = ("OK", "RESOURCE_EXHAUSTED")
#: the most callers (threads, one channel each) one level may start
MAX_CLIENTS = 256
#: the status a BadAnswer is counted under, beside the gRPC codes
BAD_ANSWER = "BAD_ANSWER"


# ---------------------------------------------------------------- the service process
class _Served:
    """One service process started for the bench (harness.serve: stopped with the bench, even a killed one), its
    gRPC target, /metrics URL and pid."""

    def __init__(self, w: Workload, log_dir: Path, tag: str, max_concurrent_rpcs: int | None = None,
                 extra_sets: dict | None = None, start_timeout: float = 300.0):
        self.port, metrics = free_ports(2)
        extra = ["--metrics-port", str(metrics)]
        if max_concurrent_rpcs is not None:
            extra += ["--max-concurrent-rpcs", str(max_concurrent_rpcs)]
        self.log = log_dir / f"{w.service}-{tag}.log"
        self.service, self.target = w.service, f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.proc = serve(w.service, self.port, {**w.sets(), **(extra_sets or {})}, self.log, extra)
        if not wait_for_health(self.target, HEALTH_NAMES[w.service], timeout=start_timeout):
            code = self.proc.poll()
            stop(self.proc)
            raise SystemExit(f"{w.service} did not start for the load bench (exit code {code}); its log "
                             f"{self.log}:\n{_tail(self.log)}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self, timeout: float = 10.0) -> str:
        """The service's readiness status name (SERVING, NOT_SERVING, ...) or the status code of the check."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        last = "UNAVAILABLE"
        with channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_NAMES[self.service]), timeout=2.0)
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
                    if last == "SERVING":
                        return last
                except grpc.RpcError as e:
                    last = e.code().name
                time.sleep(0.2)
        return last

    def queue_depth(self) -> float | None:
        """The service batcher's prorag_batcher_queue_depth from its /metrics (None when it cannot be read)."""
        return _scrape(self.metrics_url).get(("prorag_batcher_queue_depth", self.service))

    def rejected(self) -> dict:
        """prorag_batcher_rejected_total of the service's batcher by reason."""
        s = _scrape(self.metrics_url)
        return {k[2]: v for k, v in s.items() if k[0] == "prorag_batcher_rejected_total" and k[1] == self.service}

    def stop(self) -> None:
        stop(self.proc)


def _scrape(url: str) -> dict:
    """{(sample name, batcher[, reason]): value} of the batcher samples on a /metrics page ({} when unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "batcher" in s.labels:
                key = (s.name, s.labels["batcher"]) + ((s.labels["reason"],) if "reason" in s.labels else ())
                out[key] = s.value
    return out


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(unreadable: {e})"


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB (VmRSS of /proc/<pid>/status); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used, all its threads (/proc/<pid>/stat); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- driving it
def _code(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code().name
    if isinstance(exc, BadAnswer):
        return BAD_ANSWER
    return type(exc).__name__


def drive(w: Workload, served: _Served, clients: int, seconds: float, deadline_s: float,
          sample_every: float = 0.2) -> dict:
    """``clients`` callers (a thread and a channel each, connected before the clock starts) call back to back for
    ``seconds``; each call has the caller's deadline ``deadline_s``. Counts per status code, throughput (OK calls and
    their items per second of wall time, the last calls' tails included), p50/p99/max latency of the OK calls, and
    the largest batcher queue depth seen on the service's /metrics while it ran."""
    if not 1 <= clients <= MAX_CLIENTS:
        raise SystemExit(f"concurrency {clients} is outside 1..{MAX_CLIENTS}")
    made = [w.make_caller(served.target) for _ in range(clients)]
    for _, ch in made:
        grpc.channel_ready_future(ch).result(timeout=30)  # connected: no RPC, so no slot of the server is taken
    lats: list[list[float]] = [[] for _ in range(clients)]
    codes: list[dict[str, int]] = [{} for _ in range(clients)]
    items = [0] * clients
    samples: list[str] = []
    start = threading.Barrier(clients + 1)
    done = threading.Event()
    end = [0.0]

    def worker(c: int) -> None:
        call = made[c][0]
        start.wait()
        while time.monotonic() < end[0]:
            t = time.perf_counter()
            try:
                items[c] += call(deadline_s)
            except Exception as e:  # noqa: BLE001 - every outcome is counted by its status
                name = _code(e)
                codes[c][name] = codes[c].get(name, 0) + 1
                text = f"{name}: {getattr(e, 'details', lambda: str(e))()}"[:300]
                if len(samples) < 4 and not any(x[:40] == text[:40] for x in samples):  # one per kind of refusal
                    samples.append(text)
                if name == "RESOURCE_EXHAUSTED":
                    time.sleep(0.01)  # refused: a moment before the next try, as a caller backing off would
                continue
            lats[c].append(time.perf_counter() - t)
            codes[c]["OK"] = codes[c].get("OK", 0) + 1

    depths: list[float] = []

    def sampler() -> None:
        while not done.is_set():
            d = served.queue_depth()
            if d is not None:
                depths.append(d)
            done.wait(sample_every)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=sampler, daemon=True)
    end[0] = time.monotonic() + seconds
    server_cpu0, client_cpu0 = cpu_seconds(served.pid), _own_cpu_seconds()
    t0 = time.perf_counter()
    start.wait()
    watcher.start()
    for t in threads:
        t.join(seconds + deadline_s + 30)
    wall = time.perf_counter() - t0
    server_cpu1, client_cpu = cpu_seconds(served.pid), _own_cpu_seconds() - client_cpu0
    server_cpu = server_cpu1 - server_cpu0 if server_cpu0 is not None and server_cpu1 is not None else None
    done.set()
    watcher.join(10)
    for _, ch in made:
        ch.close()
    total: dict[str, int] = {}
    for cd in codes:
        for k, v in cd.items():
            total[k] = total.get(k, 0) + v
    lat = sorted(x for l in lats for x in l)
    ok = total.get("OK", 0)
    out = {"concurrency": clients, "seconds": round(wall, 3), "calls": sum(total.values()), "ok": ok,
           "errors": sum(v for k, v in total.items() if k != "OK"), "codes": dict(sorted(total.items())),
           "throughput_rps": ok / wall, f"{w.items}_per_s": sum(items) / wall,
           "p50_ms": 1e3 * percentile(lat, 0.5) if lat else None,
           "p99_ms": 1e3 * percentile(lat, 0.99) if lat else None,
           "max_ms": 1e3 * lat[-1] if lat else None,
           "max_queue_depth": max(depths) if depths else None, "queue_samples": len(depths),
           "stuck_clients": sum(t.is_alive() for t in threads),
           # CPU the service and the callers (this process) used while the level ran: on a machine whose cores both
           # share, items per server CPU-second says whether batching made the service cheaper per item, apart
           # from the callers' own cost
           "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
           f"{w.items}_per_server_cpu_s": sum(items) / server_cpu if server_cpu else None}
    if samples:
        out["error_sample"] = samples
    return out


def _levels(args) -> list[int]:
    if getattr(args, "levels", ""):
        levels = sorted({int(x) for x in str(args.levels).split(",") if x.strip()})
    else:
        levels, c = [], 1
        while c <= args.max_concurrency:
            levels.append(c)
            c *= 2
    if not levels or levels[0] < 1 or levels[-1] > MAX_CLIENTS:
        raise SystemExit(f"--levels / --max-concurrency: each level in 1..{MAX_CLIENTS}, got {levels}")
    return levels


def _warm(w: Workload, served: _Served, n: int, deadline_s: float) -> None:
    call, ch = w.make_caller(served.target)
    try:
        for _ in range(n):
            call(deadline_s)
    finally:
        ch.close()


def load_service(w: Workload, args, log_dir: Path) -> dict:
    """The rising levels on a service with its default limits, then the past-capacity phase on a fresh one."""
    levels = _levels(args)
    served = _Served(w, log_dir, "levels")
    try:
        _warm(w, served, args.warmup, args.deadline_s)
        rss_start = rss_mb(served.pid)
        runs = []
        for c in levels:
            r = drive(w, served, c, args.level_seconds, args.deadline_s)
            runs.append(r)
            if r["errors"]:
                break  # past what it holds at its default limits: rising further measures nothing more
        base, per_cpu = runs[0]["throughput_rps"], f"{w.items}_per_server_cpu_s"
        for r in runs:
            r["throughput_vs_level1"] = r["throughput_rps"] / base if base else None
            r["per_server_cpu_vs_level1"] = (r[per_cpu] / runs[0][per_cpu] if r[per_cpu] and runs[0][per_cpu]
                                             else None)
        held = [r["concurrency"] for r in runs if r["errors"] == 0]
        failed = [r["concurrency"] for r in runs if r["errors"]]
        out = {"levels": runs, "held_concurrency": max(held) if held else 0,
               "first_level_with_errors": failed[0] if failed else None,
               "capacity_found": bool(failed),
               "alive_after_levels": served.alive(), "health_after_levels": served.health(),
               "rss_mb_start": rss_start, "rss_mb_after_levels": rss_mb(served.pid)}
    finally:
        served.stop()

    limit = args.overload_rpcs
    clients = args.overload_clients or 4 * limit
    over = _Served(w, log_dir, "past-capacity", max_concurrent_rpcs=limit, extra_sets=w.overload_sets(limit))
    try:
        _warm(w, over, 1, args.deadline_s)
        rss_before = rss_mb(over.pid)
        r = drive(w, over, min(clients, MAX_CLIENTS), args.overload_seconds, args.deadline_s)
        alive, health = over.alive(), over.health()
        bound = min(limit, w.overload_sets(limit).get("max_queue", limit))
        codes = set(r["codes"])
        out["past_capacity"] = {
            **r, "max_concurrent_rpcs": limit, "clients": min(clients, MAX_CLIENTS), "deadline_s": args.deadline_s,
            **({"batcher_max_queue": w.overload_sets(limit)["max_queue"]} if w.overload_sets(limit) else {}),
            "batcher_rejected": over.rejected(),
            "allowed_codes": list(ALLOWED_PAST_CAPACITY), "only_allowed_codes": codes <= set(ALLOWED_PAST_CAPACITY),
            "ok_within_deadline": r["max_ms"] is None or r["max_ms"] <= 1e3 * args.deadline_s,
            # an admitted call waits in the batcher; at most `limit` are admitted (and the retriever's batcher holds
            # at most its max_queue), so the queue cannot pass the bound
            "queue_bound": bound, "queue_bounded": r["max_queue_depth"] is None or r["max_queue_depth"] <= bound,
            "queue_depth_read": r["max_queue_depth"] is not None,
            "alive_after": alive, "health_after": health,
            "rss_mb_before": rss_before, "rss_mb_after": rss_mb(over.pid)}
        pc = out["past_capacity"]
        pc["held"] = bool(pc["only_allowed_codes"] and pc["ok_within_deadline"] and pc["queue_bounded"]
                          and pc["queue_depth_read"] and alive and health == "SERVING" and not r["stuck_clients"])
    finally:
        over.stop()
    return out


def bench_load(args) -> dict:
    """`prorag bench load`: per service of ``--services`` (default all three) the rising levels and the
    past-capacity phase (module docstring)."""
    services = [s.strip() for s in (args.services or ",".join(LOAD_SERVICES)).split(",") if s.strip()]
    for s in services:
        if s not in LOAD_SERVICES:
            raise SystemExit(f"--services: {s!r} is not one of {', '.join(LOAD_SERVICES)}")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    loads = [load_average()]
    results = {}
    t0 = time.perf_counter()
    for s in services:
        w = workload(s, args)
        results[s] = {"items": w.items, **load_service(w, args, log_dir)}
    loads.append(load_average())
    return {"target": "load", "world": args.world, "services": results, "levels_requested": _levels(args),
            "level_seconds": args.level_seconds, "deadline_s": args.deadline_s,
            "policy_tokens": args.load_tokens if "policy" in services else None,
            "retriever_index": args.index if "retriever" in services else None,
            "all_past_capacity_held": all(r["past_capacity"]["held"] for r in results.values()),
            "goal": "past capacity only OK (within the deadline) or RESOURCE_EXHAUSTED, queue depth <= "
                    "max_concurrent_rpcs, process alive and SERVING afterwards",
            "machine": machine(), "load_average": loads, "wall_s": time.perf_counter() - t0, "logs": str(log_dir)}


# ---------------------------------------------------------------- soak
def rss_slope(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples in MB per minute (None with fewer than 3 samples or no spread
    in time)."""
    if len(samples) < 3:
        return None
    xs = [t / 60.0 for t, _ in samples]
    if max(xs) == min(xs):
        return None
    return statistics.linear_regression(xs, [m for _, m in samples]).slope


def bench_soak(args) -> dict:
    """`prorag bench soak --service S --minutes N`: ``--clients`` callers on one service for N minutes, its RSS
    sampled every ``--sample-s`` seconds (module docstring)."""
    if args.service not in LOAD_SERVICES:
        raise SystemExit(f"--service: one of {', '.join(LOAD_SERVICES)}, got {args.service!r}")
    if args.minutes <= 0 or args.sample_s <= 0:
        raise SystemExit("--minutes and --sample-s must be > 0")
    seconds = 60.0 * args.minutes
    w = workload(args.service, args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    served = _Served(w, log_dir, "soak")
    samples: list[tuple[float, float]] = []
    result: dict = {}
    try:
        _warm(w, served, args.warmup, args.deadline_s)
        box: dict = {}
        runner = threading.Thread(target=lambda: box.update(drive(w, served, args.clients, seconds, args.deadline_s,
                                                                  sample_every=max(1.0, args.sample_s))),
                                  daemon=True)
        t0 = time.monotonic()
        runner.start()
        while runner.is_alive():
            m = rss_mb(served.pid)
            if m is None:
                break  # the process is gone: reported below
            samples.append((time.monotonic() - t0, m))
            runner.join(args.sample_s)
        runner.join(args.deadline_s + 60)
        result = box
        alive, health = served.alive(), served.health()
    finally:
        served.stop()
    # Fit the samples exactly as reported, so the slope can be recomputed from the JSON (a sample at 9.996 s
    # reported as 10.0 must not fall out of the second half here and into it there).
    samples = [(round(t, 2), round(m, 2)) for t, m in samples]
    second = [(t, m) for t, m in samples if t >= seconds / 2]
    slope = rss_slope(second)
    mbs = [m for _, m in samples]
    return {"target": "soak", "service": args.service, "world": args.world, "minutes": args.minutes,
            "clients": args.clients, "sample_s": args.sample_s, "pid_sampled": "the service process (VmRSS)",
            "samples": [[t, m] for t, m in samples], "n_samples": len(samples),
            "n_samples_second_half": len(second),
            "rss_mb_first": mbs[0] if mbs else None, "rss_mb_last": mbs[-1] if mbs else None,
            "rss_mb_max": max(mbs) if mbs else None,
            "rss_mb_growth_second_half": (second[-1][1] - second[0][1]) if len(second) >= 2 else None,
            "slope_mb_per_min_second_half": slope, "flat_threshold_mb_per_min": args.flat_mb_per_min,
            "flat": slope is not None and slope < args.flat_mb_per_min,
            "load": {k: result.get(k) for k in ("calls", "ok", "errors", "codes", "throughput_rps",
                                                f"{w.items}_per_s", "p50_ms", "p99_ms", "max_queue_depth",
                                                "stuck_clients", "error_sample") if k in result},
            "alive_after": alive, "health_after": health, "machine": machine(),
            "load_average": load_average(), "log": str(served.log)}
