"""The one training loop under accelerate on 2 CPU processes (gloo, DDP through accelerate's engine, launched by
torchrun) gives the
same weights and loss as 1 process, within floating-point noise: each process computes half of every step's
micro-batches and the engine averages the gradients."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prorag.training.distributed import my_micro_batches

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_processes_cover_each_micro_batch_of_a_step_once():
    for world, k in ((1, 3), (2, 4), (4, 8)):
        for step in range(3):
            got = sorted(i for r in range(world) for i in my_micro_batches(step, k, r, world))
            assert got == list(range(step * k, (step + 1) * k))
    with pytest.raises(ValueError, match="multiple"):
        my_micro_batches(0, 3, 0, 2)


def _run(cmd, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd + [str(WORKER), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out / "weights.pt", weights_only=True)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path):
    one = _run([sys.executable], tmp_path / "one")
    port = 29500 + os.getpid() % 1000
    # torchrun sets RANK / WORLD_SIZE / MASTER_* as `accelerate launch` does on GPU hosts; accelerate's
    # Accelerator then runs the loop on the gloo backend (accelerate's own launcher wants MPI for CPU processes)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(port)], tmp_path / "two")
    assert one["processes"] == 1 and two["processes"] == 2
    assert abs(one["loss"] - two["loss"]) < 1e-5
    start = _initial()
    moved = max((one["weights"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # the run trained: a no-op on both sides would match trivially
    for k, v in one["weights"].items():
        assert torch.allclose(v, two["weights"][k], atol=1e-5, rtol=1e-4), k


def _initial() -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64))
    return m.state_dict()


@pytest.mark.slow
def test_a_trainer_stage_launched_on_two_processes_publishes_what_one_process_does(tmp_path):
    """services.trainer.launch: the SFT stage (no-retrieval mode, on the tiny world) under torchrun with 2 gloo
    processes publishes, from the main process only, the weights one process publishes."""
    import json

    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PRORAG_DATA": str(data),
           "PRORAG_TRACKING": "local"}
    env.pop("WORLD_SIZE", None)
    base = subprocess.run([sys.executable, "-c", "from prorag_app.embedded import ensure_policy_model; "
                                                 "print(ensure_policy_model('tiny'))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert base.returncode == 0, base.stderr[-2000:]
    config = tmp_path / "sft.json"
    config.write_text(json.dumps({"mode": "no_retrieval", "world": "tiny", "base_model": base.stdout.strip().splitlines()[-1],
                                  "max_questions": 32, "max_steps": 4, "batch_size": 4, "grad_accum": 2,
                                  "lr": 3e-3, "checkpoint_every": 2, "log_every": 1, "publish_name": "launched"}))
    port = 29500 + (os.getpid() + 7) % 1000
    runs = {}
    for name, prefix in (("one", [sys.executable]),
                         ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                  "--master_addr", "127.0.0.1", "--master_port", str(port)])):
        proc = subprocess.run(prefix + ["-m", "services.trainer.launch", "sft", str(config), str(tmp_path / name),
                                        "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "result.json").read_text())
    assert runs["one"]["model"] == "launched@one" and runs["two"]["model"] == "launched@two"
    from safetensors.torch import load_file

    one = load_file(data / "models" / "tiny" / "launched" / "one" / "model.safetensors")
    two = load_file(data / "models" / "tiny" / "launched" / "two" / "model.safetensors")
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5, rtol=1e-4), k
    assert abs(runs["one"]["final_loss"] - runs["two"]["final_loss"]) < 1e-5
