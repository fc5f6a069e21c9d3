"""The `warmup` stage run in process (as `prorag run` builds the base): stopped mid-way, it resumes from its
checkpoint, on the tokenizer it started with, to the weights of an uninterrupted run."""

import threading

import pytest
import torch

from prorag.config import from_dict
from prorag.errors import InvalidArgument
from prorag.training.context import local_context
from services.trainer.stage_warmup import WarmupStageConfig, run_warmup
from services.trainer.stages import get_stage, known_stages, validate_config

CONFIG = {"world": "tiny", "preset": "tiny", "vocab_size": 2048, "checkpoint_every": 4, "log_every": 1, "threads": 1,
          "warmup": {"copy_steps": 6, "sentence_steps": 2, "document_steps": 2, "batch_size": 4}}


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_warmup_stage_stops_and_resumes_in_process_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.embedded import ensure_world

    ensure_world("tiny")
    straight_cfg = from_dict(WarmupStageConfig, CONFIG)
    straight = run_warmup(local_context(tmp_path / "straight", straight_cfg))
    assert straight["steps"] == 6 + 3 * 2 + 2 and straight["final_loss"] > 0

    cfg = from_dict(WarmupStageConfig, {**CONFIG, "output": str(tmp_path / "base")})
    stop, events = threading.Event(), []

    def emit(event):
        events.append(event)
        if event.get("step") == 6 and event.get("loss") is not None:
            stop.set()
    assert run_warmup(local_context(tmp_path / "work", cfg, emit=emit, stop=stop)) == {}
    assert (tmp_path / "work" / "checkpoints" / "tokenizer").is_dir() and not (tmp_path / "base").exists()
    resumed = run_warmup(local_context(tmp_path / "work", cfg, emit=events.append))
    assert "resumed from step 6" in [e.get("message") for e in events]
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], abs=1e-6)
    a, b = _weights(tmp_path / "straight" / "run" / "model"), _weights(tmp_path / "base")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warmup_is_a_trainer_stage_with_a_strict_nested_config():
    assert "warmup" in known_stages()
    cfg = validate_config(get_stage("warmup"), CONFIG)
    assert cfg.warmup.copy_steps == 6 and cfg.warmup.lr == 3e-3  # the curriculum's own defaults fill the rest
    with pytest.raises(InvalidArgument, match="config.warmup.copy_stpes"):
        validate_config(get_stage("warmup"), {**CONFIG, "warmup": {"copy_stpes": 1}})
    with pytest.raises(InvalidArgument, match="config.preset"):
        validate_config(get_stage("warmup"), {**CONFIG, "preset": "huge"})


def test_warmup_stage_runs_in_bfloat16_on_the_cpu_through_the_gpu_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.embedded import ensure_world

    ensure_world("tiny")
    events = []
    out = run_warmup(local_context(tmp_path / "bf16", from_dict(WarmupStageConfig, {**CONFIG, "dtype": "bfloat16"}),
                                   emit=events.append))
    assert out["steps"] == 14 and 0 < out["final_loss"] < float("inf")
    assert {e["metrics"]["dtype"] for e in events if e.get("loss") is not None} == {"bfloat16"}
    weights = _weights(tmp_path / "bf16" / "run" / "model")
    assert {v.dtype for v in weights.values()} == {torch.float32}  # master weights, published as trained
