"""The embedded-default builder: worlds are used as they were built, defaults follow a world's size."""

from __future__ import annotations

import json


def test_a_world_built_with_another_seed_is_used_as_built_not_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.embedded import ensure_world

    built = ensure_world("mine", size="tiny", seed=7)
    assert built["seed"] == 7 and not built["reused"]
    again = ensure_world("mine")  # no seed asked: the world as it was built
    assert again["seed"] == 7 and again["size"] == "tiny" and again["reused"]
    # asking for another seed explicitly rebuilds it
    rebuilt = ensure_world("mine", seed=8)
    assert rebuilt["seed"] == 8 and not rebuilt["reused"]
    assert json.loads((tmp_path / "data" / "worlds" / "mine" / "world.json").read_text())["config"]["seed"] == 8


def test_a_missing_world_is_built_with_seed_zero_and_its_name_as_size(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.embedded import ensure_world

    built = ensure_world("tiny")
    assert built["seed"] == 0 and built["size"] == "tiny"


def test_the_cli_names_an_unknown_model_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.cli import main

    assert main(["eval", "--world", "tiny", "--model", "nope@v1"]) == 2
    assert "nope@v1 is not published" in capsys.readouterr().err


def test_the_copy_gate_tops_up_a_base_that_does_not_copy_and_leaves_one_that_does(tmp_path, monkeypatch):
    """The gate probes the base's name copying on the train questions' entities; under the bar it adds copy-task
    rounds (the base's bytes change, each round recorded in the marker), over it nothing is trained. A bar no
    model reaches (1.01) shows the rounds are bounded; a base built before the gate is probed, not rebuilt."""
    import hashlib

    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    from prorag_app.embedded import ensure_policy_model, policy_base_dir

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    base = ensure_policy_model("tiny")  # the tiny world has no gate
    marker = json.loads((base / "embedded.json").read_text())
    assert "copy_gate" not in marker
    warmed = digest(base)
    # the same base under a gate it cannot pass: topped up, at most `rounds` times, and not warmed up again
    unreachable = {"min_names": 1.01, "steps": 2, "lr": 1e-3, "rounds": 2}
    assert ensure_policy_model("tiny", gate=unreachable) == base
    gated = json.loads((base / "embedded.json").read_text())["copy_gate"]
    assert gated["settings"] == unreachable and gated["rounds"] == 2 and not gated["passed"]
    assert 0 <= gated["names_before"] <= 1 and 0 <= gated["names_after"] <= 1
    topped_up = digest(base)
    assert topped_up != warmed
    assert not policy_base_dir("tiny").with_name(".policy-base.build").exists()  # the work dir is cleaned up
    # asked again with the same gate: the recorded outcome stands, nothing is trained
    ensure_policy_model("tiny", gate=unreachable)
    assert digest(base) == topped_up
    # a bar every model passes: probed, no round, the bytes left as they are
    ensure_policy_model("tiny", gate={"min_names": 0.0, "steps": 2, "lr": 1e-3, "rounds": 2})
    passed = json.loads((base / "embedded.json").read_text())["copy_gate"]
    assert passed["rounds"] == 0 and passed["passed"] and digest(base) == topped_up
