"""The one registry of published artifacts (models, adapters, PRMs): publish, verify, resolve."""

import json
from pathlib import Path

import pytest

from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from prorag.registry import ArtifactRef, Manifest, Registry, published_config, registry, weights_sha256


def _saved_model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text("{}")
    return path


def test_a_published_model_records_the_config_it_was_trained_with(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    models = registry("model", "tiny")
    m = models.publish(_saved_model(tmp_path / "a", b"w1"), ArtifactRef("sft", "job-1"), base_model="base",
                       base_model_sha256="b" * 64, config={"topk": 1}, metrics={"final_loss": 0.5}, step=7)
    one = models.resolve("sft@job-1")
    assert one == tmp_path / "data" / "models" / "tiny" / "sft" / "job-1"
    assert published_config(one) == {"topk": 1}
    assert Manifest.read(one / "manifest.json") == m and m.kind == "model" and m.step == 7
    assert m.sha256 == weights_sha256(tmp_path / "a") == weights_sha256(one)
    assert published_config(tmp_path / "a") == {}  # a model directory that was never published
    # a name alone resolves to its newest version; an existing directory resolves to itself
    models.publish(_saved_model(tmp_path / "b", b"w2"), ArtifactRef("sft", "job-2"))
    assert models.resolve("sft") == models.path(ArtifactRef("sft", "job-2"))
    assert models.resolve(str(tmp_path / "a")) == tmp_path / "a"
    assert models.list() == [ArtifactRef("sft", "job-1"), ArtifactRef("sft", "job-2")]


def test_versions_are_immutable_and_republishing_the_same_weights_is_a_no_op(tmp_path):
    reg = Registry(tmp_path / "models", "model")
    src = _saved_model(tmp_path / "a", b"w1")
    first = reg.publish(src, ArtifactRef("m", "v1"))
    assert reg.publish(src, ArtifactRef("m", "v1")) == first
    with pytest.raises(AlreadyExists, match="immutable"):
        reg.publish(_saved_model(tmp_path / "b", b"w2"), ArtifactRef("m", "v1"))
    # nothing half-written is left beside the artifact
    assert not [p for p in (tmp_path / "models" / "m").iterdir() if p.name.startswith(".")]


def test_unknown_or_malformed_specs_get_clear_errors(tmp_path):
    reg = Registry(tmp_path / "models", "model")
    with pytest.raises(NotFound, match="no published versions"):
        reg.resolve("sft")
    with pytest.raises(NotFound, match="not published"):
        reg.resolve("sft@v9")
    with pytest.raises(NotFound, match="does not exist"):
        reg.resolve(str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="name@version"):
        ArtifactRef.parse("no-version")
    with pytest.raises(InvalidArgument):
        ArtifactRef.of("../escape", "v1")
    with pytest.raises(InvalidArgument, match="unknown artifact kind"):
        Registry(tmp_path, "dataset")


def test_weights_hash_identifies_the_weights(tmp_path):
    a = _saved_model(tmp_path / "a", b"w1")
    h = weights_sha256(a)
    assert len(h) == 64 and h == weights_sha256(a)
    assert weights_sha256(_saved_model(tmp_path / "b", b"w2")) != h
    with pytest.raises(NotFound):
        weights_sha256(tmp_path / "missing")


def _adapter(path: Path, payload: bytes = b"lora") -> Path:
    from safetensors.torch import save_file
    import torch

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file({"w": torch.frombuffer(bytearray(payload * 4), dtype=torch.uint8).clone()},
              str(path / "adapter_model.safetensors"))
    return path


def test_adapters_verify_before_loading(tmp_path):
    reg = Registry(tmp_path / "adapters", "adapter")
    m = reg.publish(_adapter(tmp_path / "src"), ArtifactRef("pol", "v1"), base_model="base", base_model_sha256="b" * 64)
    assert m.rank == 8 and m.kind == "adapter"
    path, manifest = reg.verify(ArtifactRef("pol", "v1"), base_model_sha256="b" * 64)
    assert path == reg.path(ArtifactRef("pol", "v1")).resolve() and manifest == m
    with pytest.raises(FailedPrecondition, match="trained on base model"):
        reg.verify(ArtifactRef("pol", "v1"), base_model_sha256="c" * 64)
    with pytest.raises(InvalidArgument, match="outside the registry root"):
        reg.verify(ArtifactRef("pol", "v1"), path="../../etc")
    with pytest.raises(NotFound):
        reg.verify(ArtifactRef("pol", "v2"))
    # corrupt weights are refused
    weights = reg.path(ArtifactRef("pol", "v1")) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="corrupt"):
        reg.verify(ArtifactRef("pol", "v1"))


def test_pickled_weights_are_never_published(tmp_path):
    src = _adapter(tmp_path / "src")
    (src / "extra.bin").write_bytes(b"pickle")
    with pytest.raises(FailedPrecondition, match="pickled"):
        Registry(tmp_path / "adapters", "adapter").publish(src, ArtifactRef("pol", "v1"))
