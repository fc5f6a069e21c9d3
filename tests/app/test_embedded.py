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
