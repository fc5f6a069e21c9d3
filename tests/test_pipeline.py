"""`prorag run`'s job identity: reuse a finished job only for the same config and the same base weights."""

from pathlib import Path

from prorag.pipeline import job_id_for


def fake_model(path: Path, weights: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_job_id_follows_config_and_base_weights_not_retriever_address(tmp_path):
    base = fake_model(tmp_path / "policy-base", b"weights v1")
    config = {"mode": "agent", "world": "default", "base_model": base, "retriever": "127.0.0.1:50051", "lr": 3e-3}
    first = job_id_for("default", "sft", config)
    assert first.startswith("default-sft-")
    assert job_id_for("default", "sft", {**config, "retriever": "127.0.0.1:50151"}) == first
    assert job_id_for("default", "sft", {**config, "lr": 1e-3}) != first
    fake_model(tmp_path / "policy-base", b"weights v2")  # base rebuilt in place: same path, new weights
    assert job_id_for("default", "sft", config) != first
