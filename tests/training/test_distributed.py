"""The one training loop under accelerate on 2 CPU processes (gloo, DDP through accelerate's engine, launched by
torchrun) gives the same weights and loss as 1 process, within floating-point noise: each process computes half of
every step's micro-batches and the engine averages the gradients. And so does every gradient stage launched
through services/trainer/launch.py, the ones that sample through the services included (only the main process
talks to them), stopped after a checkpoint and started again on the same work directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prorag.training.distributed import my_micro_batches
from tests.helpers import free_port

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
#: 2 gloo processes; --tee 3: each process's output lines prefixed with its rank, for _check
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--tee", "3", "--master_addr",
            "127.0.0.1"]


def test_processes_cover_each_micro_batch_of_a_step_once():
    for world, k in ((1, 3), (2, 4), (4, 8)):
        for step in range(3):
            got = sorted(i for r in range(world) for i in my_micro_batches(step, k, r, world))
            assert got == list(range(step * k, (step + 1) * k))
    with pytest.raises(ValueError, match="multiple"):
        my_micro_batches(0, 3, 0, 2)


def _env() -> dict:
    # PYTHONFAULTHANDLER: a process killed by a signal (a gloo thread's uncaught C++ error aborts it) prints every
    # Python thread's stack, which _check shows
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "PYTHONFAULTHANDLER": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _check(proc: subprocess.CompletedProcess) -> None:
    """Fail with what a failed launch printed, the part that says why last (CI's log keeps only its end): the
    output's tail, then each process's own lines (torchrun's --tee prefixes them "[default<rank>]:"), a process
    killed by a signal last, from the C++ error before its "Fatal Python error" through its innermost frames."""
    if proc.returncode == 0:
        return
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Extension modules:" not in ln]
    per_rank: dict[str, list[str]] = {}
    for ln in lines:
        if ln.startswith("[default") and "]:" in ln:
            per_rank.setdefault(ln.split("]:", 1)[0] + "]:", []).append(ln)
    shown = []
    for rank, own in sorted(per_rank.items(), key=lambda kv: any("Fatal Python error" in ln for ln in kv[1])):
        fatal = next((i for i, ln in enumerate(own) if "Fatal Python error" in ln), None)
        shown.append(f"--- {rank}\n" + "\n".join(own[-15:] if fatal is None else own[max(0, fatal - 4):fatal + 16]))
    pytest.fail("\n".join([f"exit {proc.returncode}", proc.stdout[-1500:] + proc.stderr[-3000:], *shown]),
                pytrace=False)


def _run(cmd, out: Path) -> dict:
    proc = subprocess.run(cmd + [str(WORKER), str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    _check(proc)
    return torch.load(out / "weights.pt", weights_only=True)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path):
    one = _run([sys.executable], tmp_path / "one")
    port = free_port()  # the other xdist worker may launch processes at the same time
    # torchrun sets RANK / WORLD_SIZE / MASTER_* as `accelerate launch` does on GPU hosts; accelerate's
    # Accelerator then runs the loop on the gloo backend (accelerate's own launcher wants MPI for CPU processes)
    two = _run(TORCHRUN + ["--master_port", str(port)], tmp_path / "two")
    assert one["processes"] == 1 and two["processes"] == 2
    assert abs(one["loss"] - two["loss"]) < 1e-5
    start = _initial()
    moved = max((one["weights"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # the run trained: a no-op on both sides would match trivially
    for k, v in one["weights"].items():
        assert torch.allclose(v, two["weights"][k], atol=1e-5, rtol=1e-4), k


@pytest.mark.slow
def test_a_launched_process_frees_its_ddp_model_before_the_process_group_goes(tmp_path):
    """A DDP wrapper left for the interpreter's exit to destroy, after the group, aborted a process in teardown now
    and then (SIGABRT; CI, stop 63): finish_distributed collects it first, however it is held."""
    proc = subprocess.run(TORCHRUN + ["--master_port", str(free_port()), str(WORKER.with_name("teardown_worker.py")),
                                      str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    _check(proc)
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"alive_before": True, "alive_after": False, "group_after": False}] * 2, got


def _initial() -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64))
    return m.state_dict()


# ---------------------------------------------------------------- every gradient stage through the launcher
STAGES = ("warmup", "sft", "prm", "rft", "rl", "dpo")
#: stages the 2-process launch stops after this step (a checkpoint is written on the way out); a second
#: 2-process launch on the same work directories resumes them
STOP_AT = {"warmup": 3, "sft": 2, "rl": 1}


def _pairs_file(path: Path) -> Path:
    """Sibling pairs labelled both ways (judge for the PRM, value for DPO)."""
    from tests.helpers import founder_pairs

    rows = [p.to_dict() for p in founder_pairs(24, 0, names=["Tova Lunn", "Kora Vell", "Arn Pell", "Mira Dost",
                                                             "Sel Varn", "Oda Kree"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _configs(stack, pairs: Path) -> dict:
    """Tiny configs of every gradient stage: 2 micro-batches per step, so 2 processes take one each."""
    common = {"world": "tiny", "threads": 1, "log_every": 1, "grad_accum": 2}
    lora = {"lora_r": 4, "lora_alpha": 8}
    return {
        "warmup": {**common, "preset": "tiny", "vocab_size": 2048, "checkpoint_every": 2,
                   "warmup": {"copy_steps": 2, "sentence_steps": 1, "document_steps": 1, "batch_size": 4}},
        "sft": {**common, "mode": "agent", "retriever": stack["retriever"], "base_model": stack["base"],
                "max_questions": 8, "max_steps": 4, "batch_size": 4, "lr": 3e-3, "checkpoint_every": 2,
                "publish_name": "sft-launch"},
        "prm": {**common, "pairs": str(pairs), "policy_model": stack["base"], "holdout": 0.25, "epochs": 1,
                "batch_size": 4, "lr": 2e-3, "max_len": 512, "checkpoint_every": 2},
        "rft": {**common, "max_questions": 4, "base_model": stack["base"], "policy": stack["policy"],
                "prm": stack["prm"], "samples_per_question": 4, "max_step_tokens": 48, "max_steps": 6,
                "questions_per_request": 4, "max_train_steps": 2, "batch_size": 4, "prm_threshold": -1e9,
                "seed": 3, "publish_name": "rft-launch"},
        "rl": {**common, **lora, "max_questions": 4, "base_model": stack["base"], "policy": stack["policy"],
               "prm": stack["prm"], "group_size": 4, "questions_per_iteration": 2, "iterations": 3,
               "max_step_tokens": 48, "max_steps": 6, "lr": 1e-3, "seed": 3, "checkpoint_every": 1,
               "rollout_adapter": "pinned"},
        "dpo": {**common, **lora, "pairs": str(pairs), "base_model": stack["base"], "batch_size": 4,
                "max_len": 512, "checkpoint_every": 2},
    }


def _launch(prefix: list[str], plan: list[dict], path: Path) -> None:
    path.write_text(json.dumps(plan))
    proc = subprocess.run(prefix + [str(WORKER.with_name("stage_worker.py")), str(path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    _check(proc)


def _published(stage: str, result: dict, work: Path) -> dict:
    """The weights the stage published: a model's or an adapter's safetensors."""
    from safetensors.torch import load_file

    from prorag.registry import registry

    if stage == "warmup":
        path = work / "run" / "model" / "model.safetensors"
    elif stage in ("sft", "rft"):
        path = registry("model", "tiny").resolve(result["model"]) / "model.safetensors"
    elif stage == "prm":
        path = registry("prm", "tiny").resolve(result["prm"]) / "model.safetensors"
    else:
        path = Path(result["adapter_path"]) / "adapter_model.safetensors"
    return load_file(str(path))


def _counting_engine():
    """The RL test's scripted policy engine, counting the sequences it generates (what RFT and RL sample; the
    policy's batcher may merge requests into fewer calls, so calls are not what is counted)."""
    from tests.services.trainer.test_rl_stage import RecordingGoldWalk

    class Counting(RecordingGoldWalk):
        sequences = 0

        def generate(self, prompts, params, adapter=None, seeds=None):
            before = len(self.calls)
            out = super().generate(prompts, params, adapter, seeds)
            if len(self.calls) > before:  # not the adapter manager's warm-up
                type(self).sequences += len(prompts) * params.n
            return out

    return Counting


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every gradient stage launched on 1 process, and on 2 (the STOP_AT ones stopped, then resumed by a second
    launch), against real retriever, policy (scripted engine) and PRM servers on loopback."""
    from tests.services.trainer.scripted_stack import scripted_stack

    root = tmp_path_factory.mktemp("launched")
    with scripted_stack(root / "data", _counting_engine()) as stack:
        configs = _configs(stack, _pairs_file(root / "data" / "pairs.jsonl"))
        work = {(run, s): root / f"{run}-{s}" for run in ("one", "two") for s in STAGES}
        port, resume_port = free_port(), free_port()  # one per launch; a worker's own, not a fixed one
        calls = [stack["engine"].sequences]  # sequences the policy generated (RFT's samples, RL's rollouts)
        _launch([sys.executable], [{"stage": s, "config": configs[s], "work_dir": str(work["one", s])}
                                   for s in STAGES], root / "plan-one.json")
        calls.append(stack["engine"].sequences)
        _launch(TORCHRUN + ["--master_port", str(port)],
                [{"stage": s, "config": configs[s], "work_dir": str(work["two", s]), "stop_at": STOP_AT.get(s)}
                 for s in STAGES], root / "plan-two.json")
        stopped = {s: {"result": json.loads((work["two", s] / "result.json").read_text()),
                       "checkpoints": sorted(p.name for p in (work["two", s] / "checkpoints").glob("step-*")),
                       "files": sorted(p.name for p in next((work["two", s] / "checkpoints").glob("step-*"),
                                                            root).iterdir())}
                   for s in STOP_AT}
        # and, last, an SFT job whose questions file is not JSON: the main process fails building the data
        bad = root / "data" / "broken.jsonl"
        bad.write_text("this is not a question\n")
        failing = {"stage": "sft", "config": {**configs["sft"], "questions": str(bad)}, "expect_error": True,
                   "work_dir": str(root / "two-sft-fails")}
        _launch(TORCHRUN + ["--master_port", str(resume_port)],
                [{"stage": s, "config": configs[s], "work_dir": str(work["two", s])} for s in STOP_AT] + [failing],
                root / "plan-resume.json")
        calls.append(stack["engine"].sequences)
        out = {"policy_calls": {"one": calls[1] - calls[0], "two": calls[2] - calls[1]},
               "errors": {r: (root / "two-sft-fails" / f"error-{r}.txt").read_text() for r in (0, 1)}}
        for s in STAGES:
            runs = {run: json.loads((work[run, s] / "result.json").read_text()) for run in ("one", "two")}
            out[s] = {**{run: r for run, r in runs.items()},
                      "weights": {run: _published(s, runs[run], work[run, s]) for run in runs},
                      "events": json.loads((work["two", s] / "events.json").read_text()),
                      "stopped": stopped.get(s), "base": stack["base"]}
        yield out


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_each_gradient_stage_launched_on_two_processes_publishes_what_one_process_does(launched, stage):
    """The stage on 2 gloo processes (each computing one of a step's 2 micro-batches, the main process alone
    fetching data through the services and publishing) ends where 1 process does: the same published weights and
    loss within floating-point noise. A stage stopped after a checkpoint and launched again resumes to them too."""
    got = launched[stage]
    one, two = got["one"], got["two"]
    # the second run really was two processes: its progress events say so
    assert {e["metrics"]["processes"] for e in got["events"] if e.get("loss") is not None} == {2}
    assert one and two and abs(one["final_loss"] - two["final_loss"]) < 1e-4, (one, two)
    a, b = got["weights"]["one"], got["weights"]["two"]
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)
    # the run trained: a no-op on both sides would match trivially
    if stage in ("rl", "dpo"):
        assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # B starts at zero
    elif stage != "warmup":
        from safetensors.torch import load_file

        start = load_file(str(Path(got["base"]) / "model.safetensors"))
        shared = [k for k in a if k in start and a[k].shape == start[k].shape]
        assert shared and max(float((a[k] - start[k]).abs().max()) for k in shared) > 1e-4
    same = {"prm": ("train_pairs", "heldout_pairs", "heldout_pairwise_accuracy"),
            "rft": ("data_sampled", "data_correct", "data_kept", "steps"),
            "rl": ("total_sampled", "total_kept", "iterations"),
            "dpo": ("train_pairs", "steps", "reward_accuracy", "mean_margin")}.get(stage, ("steps",))
    for key in same:
        assert one[key] == pytest.approx(two[key], abs=1e-4), key
    if got["stopped"] is not None:
        stopped = got["stopped"]
        assert stopped["result"] == {}  # the first launch stopped before the end
        step = STOP_AT[stage]
        assert f"step-{step:09d}" in stopped["checkpoints"]
        # every process's part (its RNG states) and the loop's own, written as one directory
        assert {"random_states_0.pkl", "random_states_1.pkl", "loop.pt"} <= set(stopped["files"])
        assert any(e.get("resumed_from_step") == step for e in got["events"])


@pytest.mark.slow
def test_only_the_main_process_of_a_launch_samples_through_the_policy(launched):
    """RFT's samples and RL's rollouts are asked for once per launch, however many processes train on them: the
    2-process launches (RL stopped and resumed, without rolling an iteration out twice) made exactly the
    1-process run's generations."""
    calls = launched["policy_calls"]
    assert calls["one"] > 0 and calls["two"] == calls["one"]


@pytest.mark.slow
def test_an_error_on_the_main_process_reaches_every_process_of_the_launch(launched):
    """The main process fails building an SFT job's data (its questions file is not JSON): it raises that error,
    and the other process, instead of waiting for data that never comes, raises one naming it."""
    main, other = launched["errors"][0], launched["errors"][1]
    assert "MainProcessFailed" not in main and "broken.jsonl" in main, main
    assert other.startswith("MainProcessFailed: the main process failed: ") and main in other, other


def test_a_launch_whose_process_count_does_not_divide_grad_accum_is_refused_before_anything_loads():
    from types import SimpleNamespace

    from services.trainer.launch import check_processes

    cfg = SimpleNamespace(grad_accum=8)
    check_processes(cfg, None)  # one process: nothing to split
    check_processes(cfg, SimpleNamespace(num_processes=4))
    with pytest.raises(SystemExit, match=r"grad_accum \(8\) is not a multiple of the 6 launched processes.*1, 2, 4, 8"):
        check_processes(cfg, SimpleNamespace(num_processes=6))
