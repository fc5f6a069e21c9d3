"""prorag_app.memo: results reused only for the same committed code and inputs, whole or not at all."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from prorag_app import memo


@pytest.fixture()
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def test_key_depends_on_every_part_and_the_code_version():
    parts = {"model": "abc", "options": {"topk": 1}}
    key = memo.memo_key("eval", parts, code="1a2b3c4")
    assert key == memo.memo_key("eval", dict(reversed(list(parts.items()))), code="1a2b3c4")  # order-free
    assert key != memo.memo_key("eval", {**parts, "options": {"topk": 3}}, code="1a2b3c4")
    assert key != memo.memo_key("eval", parts, code="5d6e7f8")
    assert key.startswith("eval-")


def test_uncommitted_or_unknown_code_never_reuses(runs):
    key = memo.memo_key("eval", {"model": "abc"}, code="")
    assert key is None
    memo.store("eval", key, {"f1": 0.5})
    assert memo.load("eval", key) is None
    assert not (runs / "cache").exists()


def test_round_trip_copies_the_files_back(runs, tmp_path):
    key = memo.memo_key("eval", {"model": "abc"}, code="1a2b3c4")
    made = tmp_path / "first" / "sft"
    made.mkdir(parents=True)
    (made / "predictions.jsonl").write_text('{"id": "q1", "prediction": "Paris"}\n')
    missing = made / "scores.png"  # a file the computation did not write is skipped, not an error
    assert memo.load("eval", key) is None
    memo.store("eval", key, {"overall": {"f1": 0.25, "f1_ci": [0.1, 0.4]}}, [made / "predictions.jsonl", missing])

    into = tmp_path / "second" / "sft"
    again = memo.load("eval", key, into=into)
    assert again == {"overall": {"f1": 0.25, "f1_ci": [0.1, 0.4]}}
    assert (into / "predictions.jsonl").read_text() == '{"id": "q1", "prediction": "Paris"}\n'
    assert sorted(p.name for p in into.iterdir()) == ["predictions.jsonl"]


def test_an_unreadable_entry_is_computed_again_and_replaced(runs):
    key = memo.memo_key("prm-validation", {"prm": "abc"}, code="1a2b3c4")
    memo.store("prm-validation", key, {"overall": 0.9})
    result = runs / "cache" / "prm-validation" / key / "result.json"
    result.write_text('{"overall": 0.')  # torn by hand: atomic stores never leave this, but a disk can
    assert memo.load("prm-validation", key) is None
    memo.store("prm-validation", key, {"overall": 0.8})
    assert json.loads(result.read_text()) == {"overall": 0.8}


def test_the_store_is_bounded_and_drops_the_least_recently_used_entries(runs, monkeypatch):
    import os

    keys = [memo.memo_key("eval", {"model": m}, code="1a2b3c4") for m in ("a", "b", "c")]
    for age, key in zip((300, 200, 100), keys):  # a oldest
        memo.store("eval", key, {"pad": "x" * 1000})
        os.utime(runs / "cache" / "eval" / key / "result.json", (0, 1_000_000 - age))
    assert memo.load("eval", keys[0]) is not None  # used now: a is the most recent
    monkeypatch.setenv("PRORAG_CACHE_MAX_BYTES", "2500")  # room for two entries
    removed = memo.prune()
    assert [p.name for p in removed] == [keys[1]]
    assert memo.load("eval", keys[1]) is None and memo.load("eval", keys[0]) and memo.load("eval", keys[2])
    # a store prunes too
    memo.store("eval", memo.memo_key("eval", {"model": "d"}, code="1a2b3c4"), {"pad": "x" * 1000})
    assert len(list((runs / "cache" / "eval").iterdir())) == 2
    monkeypatch.setenv("PRORAG_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="PRORAG_CACHE_MAX_BYTES"):
        memo.prune()
    # ... but a store under a mistyped bound keeps its entry and does not fail the run
    kept = memo.memo_key("eval", {"model": "e"}, code="1a2b3c4")
    memo.store("eval", kept, {"f1": 0.5})
    assert memo.load("eval", kept) == {"f1": 0.5}
    monkeypatch.setenv("PRORAG_CACHE_MAX_BYTES", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        memo.prune()


def test_questions_fingerprint_sees_text_answers_and_order():
    q1 = SimpleNamespace(id="q1", question="Who?", golden_answers=["A"])
    q2 = SimpleNamespace(id="q2", question="Where?", golden_answers=["B"])
    base = memo.questions_fingerprint([q1, q2])
    assert base == memo.questions_fingerprint([SimpleNamespace(**vars(q1)), q2])
    assert base != memo.questions_fingerprint([q2, q1])
    assert base != memo.questions_fingerprint([SimpleNamespace(id="q1", question="Who?", golden_answers=["C"]), q2])
    assert base != memo.questions_fingerprint([q1])


def test_code_identity_follows_the_code_directories_only(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    for d in (*memo.CODE_DIRS, "docs"):
        (repo / d).mkdir(parents=True)
        (repo / d / "x.py").write_text("a = 1\n")
    (repo / "prorag_app" / "memo.py").write_text("")  # code_identity looks for the repository above its module

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(memo, "__file__", str(repo / "prorag_app" / "memo.py"))
    first = memo.code_identity()
    assert first
    (repo / "docs" / "x.py").write_text("a = 2\n")
    assert memo.code_identity() == first  # docs edited, even uncommitted: the code is the same
    git("commit", "-qam", "docs")
    assert memo.code_identity() == first
    (repo / "services" / "x.py").write_text("a = 2\n")
    assert memo.code_identity() == ""  # uncommitted code
    git("commit", "-qam", "code")
    assert memo.code_identity() not in ("", first)
    monkeypatch.setattr(memo, "__file__", str(tmp_path / "nogit" / "prorag_app" / "memo.py"))
    (tmp_path / "nogit").mkdir()
    assert memo.code_identity() == ""
