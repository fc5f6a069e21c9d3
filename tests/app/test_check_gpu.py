"""`prorag check gpu` on a machine without a GPU: the same code runs on the CPU and says so, and every phase does
what it claims (the warm-up and SFT stages train, the policy and PRM services serve, an RL iteration hot-loads its
adapter, a streamed rollout is sampled with that adapter and scored by the PRM service, and each figure is a
measured, positive number)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prorag.training.devices import CPU_FP32
from prorag_app.check_gpu import CPU_SHAPE, sft_reference_throughput, sft_throughput

ROOT = Path(__file__).resolve().parents[2]


def test_the_sft_reference_takes_the_same_optimizer_steps_as_our_loop():
    """The reference beside our SFT figure is the same optimisation written with plain transformers: from the same
    weights on the same batches its six steps move the weights as ours do and end at our loss, so the two rates
    compare like for like."""
    ours = sft_throughput(CPU_SHAPE, CPU_FP32, 2, 32, 6, compile=False)
    ref = sft_reference_throughput(CPU_SHAPE, CPU_FP32, 2, 32, 6, compile=False)
    assert ref["num_parameters"] == ours["num_parameters"] and ref["steps"] == ours["steps"] == 6
    assert ref["weights_norm_start"] == ours["weights_norm_start"]
    moved = ours["weights_norm_end"] - ours["weights_norm_start"]
    # the steps moved the weights, and the reference's moved them the same way (a learning rate 10% off moves the
    # norm 8% more: measured)
    assert abs(moved) > 1e-3
    assert ref["weights_norm_end"] - ref["weights_norm_start"] == pytest.approx(moved, rel=0.01)
    assert ref["final_loss"] == pytest.approx(ours["final_loss"], abs=3e-5)
    assert ref["tokens_per_s"] > 0 and ref["mfu"] == pytest.approx(
        ref["tokens_per_s"] * 6 * ref["num_parameters"] / ref["peak_flops"])


@pytest.mark.slow
def test_check_gpu_runs_every_phase_on_the_cpu_and_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PRORAG_HOME", "PRORAG_DATA", "PRORAG_RUNS")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "prorag_app.cli", "check", "gpu", "--json", "--quick",
                           "--work", str(tmp_path / "check")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v.get("error") for k, v in out["phases"].items() if not v["ok"]}
    assert proc.returncode == 0 and out["ok"] and not failed, (failed, proc.stderr[-3000:])
    assert out["ran_on"] == "cpu" and "no GPU here" in out["note"]
    ph = out["phases"]
    assert ph["sft_stage"]["placement"]["device"] == "cpu" and ph["sft_stage"]["steps"] == 6
    assert ph["services"]["policy_device"] == "cpu"
    rl = ph["rl_iteration"]
    assert rl["iterations"] == 1 and rl["push_acked"] == 1.0 and rl["total_sampled"] == 16
    roll = ph["rollout_and_prm"]
    # the streamed rollout was sampled with the adapter the RL iteration published and hot-loaded
    assert roll["trajectories"] == 16 and roll["adapter_versions_served"] == [rl["adapter"]]
    assert roll["scores_finite"] and roll["prm_steps_scored_per_call"] > 0
    fig = out["figures"]
    for key in ("sft_eager_tokens_per_s", "sft_eager_mfu", "prm_steps_per_s", "decode_bare_forward_tokens_per_s",
                "decode_engine_compile_off_tokens_per_s", "decode_bandwidth_limit_tokens_per_s",
                "sft_reference_eager_tokens_per_s", "sft_reference_eager_mfu", "sft_eager_vs_reference"):
        assert fig[key] > 0, key
    assert 0 < fig["decode_engine_compile_off_fraction_of_bandwidth_limit"] < 1
    assert ph["sft_eager"]["peak_flops"] == pytest.approx(ph["peaks"]["matmul_flops"])
    # the fused head loss is a CUDA kernel: on the CPU its phases say so instead of running
    for name in ("sft_fused_ce", "sft_compiled_fused_ce"):
        assert ph[name]["ran"] is False and "CUDA kernel" in ph[name]["skipped"], ph[name]
        assert f"{name}_mfu" not in fig
    assert out["goals"] == {"sft_mfu": 0.45, "decode_fraction_of_bandwidth_limit": 0.20}
    # what a check stopped part-way would have left: every phase's result as it finished
    progress = json.loads((tmp_path / "check" / "progress.json").read_text())
    assert progress["phases"] == json.loads(json.dumps(ph)) and progress["failed"] == []
