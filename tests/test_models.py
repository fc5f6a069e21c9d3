"""The model registry: what a published model records about how it was trained."""

from pathlib import Path

from prorag.models import publish_model, resolve_model, trained_topk


def _saved_model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_published_model_says_how_many_documents_per_search_it_was_trained_with(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    one = publish_model(_saved_model(tmp_path / "a", b"w1"), "tiny", "sft", "job-1", extra={"topk": 1})
    assert resolve_model("tiny", "sft@job-1") == one
    assert trained_topk(one) == 1
    older = publish_model(_saved_model(tmp_path / "b", b"w2"), "tiny", "sft", "job-0")  # before the field
    assert trained_topk(older) is None
    assert trained_topk(tmp_path / "a") is None  # a model directory that was never published
