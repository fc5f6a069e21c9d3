"""`prorag bench load` and `prorag bench soak` (issue 31 item 3) on the tiny world with tiny bounds: the JSON's shape
and sanity, the past-capacity phase's statuses and the server's health after it, RSS samples of a short soak. No
timing is asserted: only counts, orderings and the invariants the benchmarks report."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import pytest

from prorag_app.bench.load import cpu_seconds
from tests.helpers import env


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny world with its BM25 index only (the dense one is the slow one to build, and not needed here).
    The benchmarks keep their services' logs in a new temporary directory each (they print where): here that
    directory is made under the test's own, so the suite leaves nothing behind in the system's."""
    root = tmp_path_factory.mktemp("bench-load")
    data = root / "data"
    (root / "tmp").mkdir()
    with env("PRORAG_DATA", str(data)), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(root / "tmp"))
        from prorag_app.embedded import ensure_indexes

        ensure_indexes("tiny", dense=False)
        yield data


def _args(**kw) -> argparse.Namespace:
    base = dict(world="tiny", index="bm25", model="sft", services="retriever", levels="1,2", max_concurrency=2,
                level_seconds=1.5, deadline_s=15.0, overload_rpcs=2, overload_clients=0, overload_seconds=2.0,
                load_tokens=8, warmup=2, service="retriever", minutes=20 / 60, sample_s=1.0, clients=2,
                flat_mb_per_min=2.0)
    base.update(kw)
    return argparse.Namespace(**base)


def _live_servers() -> set[int]:
    from prorag_app import procs

    return {p.pid for p in procs.live() if p.poll() is None}


def test_bench_load_reports_levels_and_what_happens_past_capacity(data):
    import json

    from prorag_app.bench.load import ALLOWED_PAST_CAPACITY, bench_load
    from prorag_app.bench.workloads import batcher_queue_limit

    before = _live_servers()
    out = bench_load(_args())
    json.dumps(out)  # what --json prints
    assert _live_servers() == before  # both servers it started are stopped
    assert out["target"] == "load" and out["levels_requested"] == [1, 2] and set(out["services"]) == {"retriever"}
    r = out["services"]["retriever"]
    assert r["items"] == "queries"
    levels = r["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2][:len(levels)]
    first = levels[0]
    assert first["errors"] == 0 and first["ok"] > 0 and first["codes"] == {"OK": first["ok"]}
    for lv in levels:
        assert lv["calls"] == sum(lv["codes"].values()) and lv["errors"] == lv["calls"] - lv["ok"]
        if lv["ok"]:
            assert 0 < lv["p50_ms"] <= lv["p99_ms"] <= lv["max_ms"]
            assert lv["throughput_rps"] > 0 and lv["queries_per_s"] == pytest.approx(lv["throughput_rps"])
        assert lv["stuck_clients"] == 0 and lv["queue_samples"] > 0
        # the service's and the callers' CPU while the level ran, and the service's cost per item from it
        assert lv["server_cpu_s"] > 0 and lv["client_cpu_s"] > 0
        assert lv["queries_per_server_cpu_s"] == pytest.approx(lv["queries_per_s"] * lv["seconds"] / lv["server_cpu_s"],
                                                               rel=1e-3)
    assert first["throughput_vs_level1"] == 1.0 and first["per_server_cpu_vs_level1"] == 1.0
    held = [lv["concurrency"] for lv in levels if lv["errors"] == 0]
    assert r["held_concurrency"] == max(held) >= 1
    assert r["alive_after_levels"] and r["health_after_levels"] == "SERVING"
    assert r["rss_mb_start"] > 0

    pc = r["past_capacity"]
    assert pc["max_concurrent_rpcs"] == 2 and pc["clients"] == 8 and pc["concurrency"] == 8
    assert pc["batcher_max_queue"] == batcher_queue_limit(2) and pc["queue_bound"] == min(2, batcher_queue_limit(2))
    assert pc["calls"] == sum(pc["codes"].values()) > 0
    assert set(pc["codes"]) <= set(ALLOWED_PAST_CAPACITY), pc.get("error_sample")
    assert pc["only_allowed_codes"] and pc["codes"].get("OK", 0) > 0
    assert pc["codes"].get("RESOURCE_EXHAUSTED", 0) > 0  # 8 callers against 2 slots: it was driven past capacity
    assert pc["queue_depth_read"] and pc["max_queue_depth"] <= pc["queue_bound"] and pc["queue_bounded"]
    assert pc["ok_within_deadline"] and pc["max_ms"] <= 1e3 * pc["deadline_s"]
    assert pc["alive_after"] and pc["health_after"] == "SERVING" and pc["stuck_clients"] == 0
    assert pc["held"] and out["all_past_capacity_held"]


def test_cpu_seconds_reads_a_live_process_and_none_once_it_is_gone():
    mine = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # burn some CPU in this process
    assert cpu_seconds(os.getpid()) > mine >= 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu_seconds(child.pid) is None  # reaped: no /proc entry


def test_bench_soak_samples_the_service_rss_and_fits_the_second_half(data):
    from prorag_app.bench.load import bench_soak, rss_slope

    before = _live_servers()
    out = bench_soak(_args())
    assert _live_servers() == before
    assert out["target"] == "soak" and out["service"] == "retriever"
    samples = out["samples"]
    assert out["n_samples"] == len(samples) >= 5
    times = [t for t, _ in samples]
    assert times == sorted(times) and times[0] >= 0 and times[-1] <= 60 * out["minutes"] + 5
    mbs = [m for _, m in samples]
    assert all(m > 0 for m in mbs)
    assert out["rss_mb_first"] == pytest.approx(mbs[0], abs=0.01)
    assert out["rss_mb_last"] == pytest.approx(mbs[-1], abs=0.01)
    assert out["rss_mb_max"] == pytest.approx(max(mbs), abs=0.01)
    assert out["rss_mb_max"] >= max(out["rss_mb_first"], out["rss_mb_last"])
    second = [(t, m) for t, m in samples if t >= 30 * out["minutes"]]
    assert out["n_samples_second_half"] == len(second) >= 3
    assert out["slope_mb_per_min_second_half"] == pytest.approx(rss_slope(second), abs=0.05)
    assert out["flat"] == (out["slope_mb_per_min_second_half"] < out["flat_threshold_mb_per_min"])
    load = out["load"]
    assert load["errors"] == 0 and load["ok"] > 0 and load["calls"] == load["ok"]
    assert load["p50_ms"] <= load["p99_ms"]
    assert out["alive_after"] and out["health_after"] == "SERVING"


def test_rss_slope_is_megabytes_per_minute_of_a_least_squares_fit():
    from prorag_app.bench.load import rss_slope

    assert rss_slope([(0, 100.0), (30, 101.0), (60, 102.0), (90, 103.0)]) == pytest.approx(2.0)
    assert rss_slope([(0, 100.0), (60, 100.0), (120, 100.0)]) == pytest.approx(0.0)
    assert rss_slope([(0, 100.0), (60, 100.0)]) is None  # too few samples to fit


def test_levels_double_up_to_the_bound_or_are_given():
    from prorag_app.bench.load import MAX_CLIENTS, _levels

    assert _levels(_args(levels="", max_concurrency=20)) == [1, 2, 4, 8, 16]
    assert _levels(_args(levels="4,1,2")) == [1, 2, 4]
    with pytest.raises(SystemExit):
        _levels(_args(levels=f"1,{MAX_CLIENTS + 1}"))
