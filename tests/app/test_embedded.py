"""The embedded-default builder: worlds are used as they were built, defaults follow a world's size, and a base
shipped with the code is installed only when it is the one that would be built."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prorag.errors import InvalidArgument
from prorag.io import sha256_file
from prorag.registry import weights_sha256
from prorag_app import embedded
from prorag_app.cli import build_parser, main
from prorag_app.profiles import PROFILES
from services.trainer import stage_warmup


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


# --- the shipped base (prorag_app.embedded.SHIPPED_BASES) ---------------------------------------------------------

SHIP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ship_base.py"


def ship_script():
    spec = importlib.util.spec_from_file_location("prorag_ship_base_script", SHIP_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the profiles that train on their world's default warm-up, so a base of theirs is shipped
SHIPPED_PROFILES = sorted(name for name, p in PROFILES.items()
                          if p.world == "default" and p.base_warmup is None and p.base_source == "shipped")


@pytest.mark.parametrize("profile", SHIPPED_PROFILES)
def test_each_default_world_profile_finds_a_shipped_base_with_intact_files(profile):
    """A change of a profile's preset, vocabulary, warm-up or the tokenizer's version must ship a new base (or
    drop it): otherwise `make run` (or the research run) silently warms one up again."""
    prof = PROFILES[profile]
    want = embedded.base_spec("default", "default", prof.model_preset, prof.vocab_size)
    found = [src for src, prov in embedded.shipped_bases("default").items() if prov["spec"] == want]
    assert len(found) == 1, f"re-ship {profile}'s base: python scripts/ship_base.py"
    shipped = found[0]
    prov = json.loads((shipped / embedded.PROVENANCE).read_text())
    assert {p.name for p in shipped.iterdir()} == {*prov["files"], embedded.PROVENANCE}
    for name, digest in prov["files"].items():
        assert sha256_file(shipped / name) == digest, name
    assert prov["built"]["commit"] and prov["built"]["machine"]


def test_every_shipped_base_is_some_profiles():
    """A base no profile builds is 10+ MB that every clone and wheel carries for nothing."""
    wanted = [embedded.base_spec("default", "default", PROFILES[p].model_preset, PROFILES[p].vocab_size)
              for p in SHIPPED_PROFILES]
    assert {"default", "research"} <= set(SHIPPED_PROFILES)
    for src, prov in embedded.shipped_bases("default").items():
        assert prov["spec"] in wanted, src.name


@pytest.fixture
def tiny_shipped(tmp_path, monkeypatch):
    """A tiny world's base built here, shipped by scripts/ship_base.py into a temporary SHIPPED_BASES, and the
    built copy removed: what a fresh clone of the default world sees. Yields (shipped dir, warm-up calls)."""
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(embedded, "SHIPPED_BASES", tmp_path / "bases")
    script = ship_script()
    monkeypatch.setattr(script, "SHIPPED_BASES", tmp_path / "bases")
    built = embedded.ensure_policy_model("tiny", source="build")
    assert script.main(["--world", "tiny", "--command", "pytest", "--commit", "abc1234", "--machine", "here",
                        "--date", "2026-11-30"]) == 0
    built_sha = weights_sha256(built)
    shutil.rmtree(built)
    calls = []
    real = stage_warmup.run_warmup
    monkeypatch.setattr(stage_warmup, "run_warmup", lambda ctx: calls.append(ctx) or real(ctx))
    yield tmp_path / "bases" / "tiny", built_sha, calls


def test_a_matching_shipped_base_is_installed_without_a_warm_up(tiny_shipped):
    shipped, built_sha, calls = tiny_shipped
    said = []
    out = embedded.ensure_policy_model("tiny", say=said.append)
    assert calls == [] and weights_sha256(out) == built_sha
    assert json.loads((out / "embedded.json").read_text()) == embedded.base_spec("tiny", "tiny")
    assert json.loads((out / embedded.SHIPPED_MARKER).read_text())["built"]["commit"] == "abc1234"
    assert "installed the one shipped" in said[0] and "abc1234" in said[0]
    # installed once: asked again, nothing is copied or built
    assert embedded.ensure_policy_model("tiny", say=said.append) == out and len(said) == 1 and calls == []


def test_asking_for_a_base_built_here_replaces_an_installed_shipped_one(tiny_shipped):
    shipped, built_sha, calls = tiny_shipped
    out = embedded.ensure_policy_model("tiny")
    assert (out / embedded.SHIPPED_MARKER).exists()
    embedded.ensure_policy_model("tiny", source="build")
    assert len(calls) == 1 and not (out / embedded.SHIPPED_MARKER).exists()
    assert json.loads((out / "embedded.json").read_text()) == embedded.base_spec("tiny", "tiny")
    # the default lookup (services, `prorag up`) takes the built one as it is
    assert embedded.ensure_policy_model("tiny") == out and len(calls) == 1


@pytest.mark.parametrize("damage, reason", [
    ("weights", "does not match its recorded sha256"),
    ("world", "built from other 'tiny' world files"),
    ("settings", "was built with these settings (warmup differ from tiny's)"),
])
def test_a_shipped_base_that_is_not_the_one_asked_for_is_named_and_a_base_is_built(tiny_shipped, damage, reason):
    shipped, built_sha, calls = tiny_shipped
    warmup = None
    if damage == "weights":
        with open(shipped / "model.safetensors", "r+b") as fh:
            fh.seek(-8, 2)
            fh.write(b"\0" * 8)
    elif damage == "world":
        prov = json.loads((shipped / embedded.PROVENANCE).read_text())
        prov["world_fingerprint"] = "0" * 64
        (shipped / embedded.PROVENANCE).write_text(json.dumps(prov))
    else:
        warmup = {**embedded.DEFAULT_WARMUP["tiny"], "copy_steps": 3}
    said = []
    out = embedded.ensure_policy_model("tiny", warmup=warmup, say=said.append)
    assert len(calls) == 1 and not (out / embedded.SHIPPED_MARKER).exists()
    assert reason in said[0] and "warmed up here" in said[0]


def test_an_unknown_base_source_is_refused():
    with pytest.raises(InvalidArgument, match="base source 'hub'"):
        embedded.ensure_policy_model("tiny", source="hub")
    with pytest.raises(InvalidArgument, match="base_source 'hub'"):
        dataclasses.replace(PROFILES["tiny"], base_source="hub")


def test_prorag_base_offers_the_base_sources_and_prints_only_the_directory(tiny_shipped, capsys):
    """The CLI keeps its parser free of the builder's imports, so its choices are written out: they must stay the
    builder's."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    source = next(a for a in sub.choices["base"]._actions if a.dest == "source")
    assert tuple(source.choices) == embedded.BASE_SOURCES and source.default == "shipped"
    assert main(["base", "--world", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()) == embedded.policy_base_dir("tiny") and "installed the one shipped" in err


def test_the_wheel_carries_the_shipped_base(tmp_path):
    """Images install the project as a wheel (scripts/docker/build_venv.sh), so their `prorag setup` installs the
    shipped base only if the wheel holds it (pyproject.toml's package-data)."""
    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for pkg in ("prorag", "prorag_app", "services"):
        shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("prorag-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p for p in embedded.SHIPPED_BASES.glob("*/*") if p.is_file()]
    assert shipped
    for p in shipped:
        assert f"prorag_app/bases/{p.parent.name}/{p.name}" in names


def test_ship_base_refuses_an_installed_shipped_base_and_one_built_with_other_settings(tiny_shipped, capsys,
                                                                                      monkeypatch):
    script = ship_script()
    monkeypatch.setattr(script, "SHIPPED_BASES", embedded.SHIPPED_BASES)
    args = ["--world", "tiny", "--command", "pytest", "--commit", "abc1234", "--machine", "here", "--date", "today"]
    embedded.ensure_policy_model("tiny")  # the shipped one, installed
    assert script.main(args) == 2 and "installed shipped base" in capsys.readouterr().err
    embedded.ensure_policy_model("tiny", warmup={**embedded.DEFAULT_WARMUP["tiny"], "copy_steps": 3})
    assert script.main(args) == 2 and "not built with the current code's settings" in capsys.readouterr().err
    # one base per spec: the same base shipped again under another name is refused
    embedded.ensure_policy_model("tiny", warmup=embedded.DEFAULT_WARMUP["tiny"], source="build")
    assert script.main([*args, "--name", "tiny-again"]) == 2 and "one base per spec" in capsys.readouterr().err


def test_a_world_ships_a_base_per_model_and_each_is_installed_where_its_profile_looks(tiny_shipped, monkeypatch):
    """The default world ships `make run`'s base and the research profile's (another preset, its own base_variant):
    each is picked by its spec and installed without a warm-up, into the directory its profile reads."""
    shipped, built_sha, calls = tiny_shipped
    script = ship_script()
    monkeypatch.setattr(script, "SHIPPED_BASES", embedded.SHIPPED_BASES)
    other = embedded.ensure_policy_model("tiny", preset="tiny-h32", variant="h32", source="build")
    assert script.main(["--world", "tiny", "--variant", "h32", "--preset", "tiny-h32", "--name", "tiny-h32",
                        "--command", "pytest", "--commit", "def5678", "--machine", "here", "--date", "today"]) == 0
    other_sha = weights_sha256(other)
    shutil.rmtree(other)
    calls.clear()
    assert [p.name for p in embedded.shipped_bases("tiny")] == ["tiny", "tiny-h32"]
    said = []
    out = embedded.ensure_policy_model("tiny", preset="tiny-h32", variant="h32", say=said.append)
    assert out == embedded.policy_base_dir("tiny", "h32") and weights_sha256(out) == other_sha
    assert calls == [] and "def5678" in said[0]
    out = embedded.ensure_policy_model("tiny", say=said.append)
    assert out == embedded.policy_base_dir("tiny") and weights_sha256(out) == built_sha and calls == []
