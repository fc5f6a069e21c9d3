"""`prorag bench sft`: training tokens/s and MFU against the peak of the dtype the steps compute in."""

import argparse

import pytest
import torch

from prorag.errors import FailedPrecondition
from prorag.training.flops import peak_matmul_flops
from prorag_app.bench.sft import bench_sft


def bench_args(tiny_policy, **overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"world": "tiny", "model": str(tiny_policy[0]), "batch": 2, "seq_len": 32,
                                 "iters": 3, "repeats": 1, "device": "cpu", "dtype": "float32", "compile": False,
                                 "fused_ce": False, **overrides})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_sft_measures_mfu_against_the_peak_of_the_dtype_it_computes_in(tiny_policy, dtype):
    out = bench_sft(bench_args(tiny_policy, dtype=dtype))
    assert out["dtype"] == dtype and out["device"] == "cpu" and out["steps_per_repeat"] == 3
    assert out["tokens_per_s"] > 0 and out["mfu"] > 0
    assert out["peak_matmul_flops"] == peak_matmul_flops("cpu", getattr(torch, dtype))
    assert out["fused_linear_ce"] is False


def test_bench_sft_refuses_the_fused_head_loss_on_a_cpu_before_it_trains(tiny_policy):
    with pytest.raises(FailedPrecondition, match="CUDA devices only"):
        bench_sft(bench_args(tiny_policy, fused_ce=True))
