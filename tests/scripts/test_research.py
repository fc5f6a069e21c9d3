"""scripts/research.sh carries the research run's home between machines: `pack` copies what cannot be rebuilt
cheaply, `unpack` restores it where the run expects it. Run as a subprocess on a home laid out as a real run's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "research.sh"


def _write(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _job(home: Path, job_id: str, state: str, checkpoints: tuple[str, ...]) -> None:
    root = home / "runs" / "jobs" / job_id
    _write(root / "job.json", json.dumps({"id": job_id, "state": state}, indent=2))
    _write(root / "events.jsonl")
    _write(root / "run" / "metrics.jsonl")
    _write(root / "run" / "wandb" / "offline-run.wandb")
    for name in checkpoints:
        _write(root / "checkpoints" / name)


@pytest.fixture
def research(tmp_path):
    """A research directory whose MANIFEST names a home under tmp_path, and that home as a run leaves it."""
    research = tmp_path / "research"
    home = tmp_path / "rhome"
    _write(research / "MANIFEST", f"commit=HEAD\nhome={home}\ncode={tmp_path / 'rcode'}\n")
    _write(home / "data" / "worlds" / "default" / "train.jsonl")
    _write(home / "data" / "indexes" / "default" / "dense" / "index.faiss")
    _write(home / "data" / "models" / "default" / "policy-base-4l" / "model.safetensors")  # the shipped base
    _write(home / "data" / "models" / "default" / "sft" / "model.safetensors")
    _write(home / "runs" / "jobs" / ".trainer.lock")
    _write(home / "runs" / "cache" / "eval-0123.json")
    _write(home / "runs" / "20261201T105257Z-run-research-seed1" / "results.json")
    _write(home / "runs" / "20261201T105257Z-run-research-seed1" / "logs" / "stack" / "policy.log")
    _job(home, "default-sft-done", "SUCCEEDED", ("model.safetensors", "optimizer.pt"))
    _job(home, "default-rl-half", "RUNNING", ("step-000000200.pt", "step-000000400.pt", "rl-iterations.jsonl",
                                               "sft_data.pt"))
    _job(home, "default-fsdp-half", "RUNNING", ("step-000000100/model.safetensors", "step-000000300/model.safetensors",
                                               "step-000000300/optimizer.bin"))
    _job(home, "default-rlpool-half", "RUNNING", ("rlpool-journal.jsonl",))
    return research, home


def _run(research: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "RESEARCH_DIR": str(research)},
                          capture_output=True, text=True, timeout=60)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_pack_keeps_what_cannot_be_rebuilt_cheaply(research):
    research_dir, home = research
    done = _run(research_dir, "pack")
    assert done.returncode == 0, done.stderr
    assert _files(research_dir / "home") == {
        "data/worlds/default/train.jsonl",
        "data/indexes/default/dense/index.faiss",
        "data/models/default/sft/model.safetensors",
        "runs/cache/eval-0123.json",
        "runs/20261201T105257Z-run-research-seed1/results.json",
        "runs/jobs/default-sft-done/job.json",
        "runs/jobs/default-sft-done/events.jsonl",
        "runs/jobs/default-sft-done/run/metrics.jsonl",
        "runs/jobs/default-rl-half/job.json",
        "runs/jobs/default-rl-half/events.jsonl",
        "runs/jobs/default-rl-half/run/metrics.jsonl",
        "runs/jobs/default-fsdp-half/job.json",
        "runs/jobs/default-fsdp-half/events.jsonl",
        "runs/jobs/default-fsdp-half/run/metrics.jsonl",
        "runs/jobs/default-rlpool-half/job.json",
        "runs/jobs/default-rlpool-half/events.jsonl",
        "runs/jobs/default-rlpool-half/run/metrics.jsonl",
        "runs/jobs/default-rlpool-half/checkpoints/rlpool-journal.jsonl",
        # an unfinished job resumes from its newest checkpoint (a file, or a launch's directory) and its journals;
        # the finished one's outputs are its model
        "runs/jobs/default-rl-half/checkpoints/step-000000400.pt",
        "runs/jobs/default-rl-half/checkpoints/rl-iterations.jsonl",
        "runs/jobs/default-fsdp-half/checkpoints/step-000000300/model.safetensors",
        "runs/jobs/default-fsdp-half/checkpoints/step-000000300/optimizer.bin",
    }


def test_pack_replaces_the_previous_pack(research):
    research_dir, home = research
    assert _run(research_dir, "pack").returncode == 0
    (home / "runs" / "cache" / "eval-0123.json").unlink()
    _write(home / "runs" / "cache" / "eval-4567.json")
    assert _run(research_dir, "pack").returncode == 0
    cache = research_dir / "home" / "runs" / "cache"
    assert sorted(p.name for p in cache.iterdir()) == ["eval-4567.json"]


def test_pack_refuses_while_the_run_is_live(research):
    research_dir, home = research
    Path(f"{home}.pid").write_text(str(os.getpid()))  # a live process stands in for the run
    done = _run(research_dir, "pack")
    assert done.returncode == 1 and "stop the run first" in done.stdout
    assert not (research_dir / "home").exists()


def test_unpack_restores_the_pack_and_never_mixes_two_homes(research, tmp_path):
    research_dir, home = research
    assert _run(research_dir, "pack").returncode == 0
    packed = _files(research_dir / "home")

    refused = _run(research_dir, "unpack")  # the home is still there
    assert refused.returncode == 1 and "exists" in refused.stdout

    home.rename(tmp_path / "old-home")  # a new machine: nothing outside the repository
    done = _run(research_dir, "unpack")
    assert done.returncode == 0, done.stderr
    assert _files(home) == packed
    assert json.loads((home / "runs" / "jobs" / "default-rl-half" / "job.json").read_text())["state"] == "RUNNING"


def test_unknown_command_prints_the_usage():
    done = subprocess.run(["bash", str(SCRIPT), "frobnicate"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "scripts/research.sh pack" in done.stdout
