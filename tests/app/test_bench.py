"""prorag_app.bench's decode limit: the bare batched forward pass runs on the engine's own model and prompts and
reports tokens/s of what it generated; bench_decode sets the engine's figure against it."""

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def engine(tiny_policy):
    from services.policy.engine import TransformersEngine

    return TransformersEngine(str(tiny_policy[0]), max_batch_size=64)


def test_bare_decode_counts_every_row_and_step(engine):
    from prorag_app.bench import bare_decode_tokens_per_s

    rate = bare_decode_tokens_per_s(engine.base, [[5, 6, 7], [8, 9]], new_tokens=4, pad_id=engine.pad_id)
    assert rate > 0


def test_bench_decode_compares_the_engine_with_the_bare_forward_pass_at_one_batch_size(engine):
    from prorag_app.bench import bench_decode

    qs = [SimpleNamespace(question=f"Who founded Kest {i}?") for i in range(3)]
    out = bench_decode(engine, qs, batch=6, new_tokens=8, repeats=1)
    assert out["batch"] == 6 and out["new_tokens"] == 8
    assert out["engine_tokens_per_s"] > 0 and out["bare_forward_tokens_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["engine_tokens_per_s"] / out["bare_forward_tokens_per_s"])


def test_bench_rl_times_one_padded_pass_against_length_chunks(tiny_policy, monkeypatch, tmp_path):
    import argparse

    from prorag_app.bench import bench_rl

    monkeypatch.setenv("PRORAG_RUNS", str(tmp_path / "runs"))  # no saved trajectories: uniform lengths
    model_dir, _ = tiny_policy
    out = bench_rl(argparse.Namespace(world="tiny", model=str(model_dir), questions=2, samples=4, repeats=1))
    assert out["trajectories"] == 8 and out["lengths_from"] == "uniform 200-1000"
    assert out["one_pass"]["chunks"] == 1 and out["chunked"]["chunks"] >= 1
    assert out["chunked"]["padded_tokens"] <= out["one_pass"]["padded_tokens"]
    assert out["one_pass"]["padded_tokens"] >= out["tokens"] and out["ratio"] > 0
    assert out["step_split"] == {} and out["step_split_from"] is None  # no `prorag run` yet


def test_rl_step_split_gives_each_part_of_an_iteration_and_its_share():
    from prorag_app.bench import rl_step_split

    results = {"stage34": {"rl": {"prorag": {"median_rollout_s": 6.0, "median_prm_scoring_s": 3.0,
                                             "median_reward_s": 0.0, "median_update_s": 10.0,
                                             "median_adapter_sync_s": 1.0, "iterations": 10},
                                  "outcome_grpo": {"median_rollout_s": 5.0, "median_update_s": 5.0}}}}
    split = rl_step_split(results)
    assert split["prorag"]["iteration_s"] == 20.0
    assert split["prorag"]["update_share"] == 0.5 and split["prorag"]["prm_scoring_share"] == 0.15
    assert split["outcome_grpo"]["prm_scoring_s"] == 0.0 and split["outcome_grpo"]["rollout_share"] == 0.5
    assert rl_step_split({"methods": {}}) == {} and rl_step_split({"stage34": None}) == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_sft_measures_mfu_against_the_peak_of_the_dtype_it_computes_in(tiny_policy, dtype):
    import argparse

    import torch

    from prorag.training.flops import peak_matmul_flops
    from prorag_app.bench import bench_sft

    out = bench_sft(argparse.Namespace(world="tiny", model=str(tiny_policy[0]), batch=2, seq_len=32, iters=3,
                                       repeats=1, device="cpu", dtype=dtype, compile=False))
    assert out["dtype"] == dtype and out["device"] == "cpu" and out["steps_per_repeat"] == 3
    assert out["tokens_per_s"] > 0 and out["mfu"] > 0
    assert out["peak_matmul_flops"] == peak_matmul_flops("cpu", getattr(torch, dtype))
