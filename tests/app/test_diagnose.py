"""prorag_app.diagnose: which questions `prorag diagnose rl` reads as the RL's own."""

from __future__ import annotations

import json

from prorag import paths
from prorag.data.loaders import load_split
from prorag_app.diagnose import question_sets
from prorag_app.embedded import ensure_world


def test_the_pool_set_is_the_questions_the_rl_drew_from_not_the_whole_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    ensure_world("tiny")
    train = load_split(paths.world_dir("tiny"), "train")
    rates = {q.id: r for q, r in zip(train[:6], (0.125, 0.5, 0.625, 0.875, 0.25, 0.75))}
    pool = tmp_path / "pool.json"
    pool.write_text(json.dumps({"world": "tiny", "split": "train", "pool": list(rates),
                                "questions": {q: {"solve_rate": r} for q, r in rates.items()}}))
    run = {"world": "tiny", "run_dir": str(tmp_path),
           "stage34": {"pool": {"path": str(pool)}, "settings": {"rl": {"pool_max_solve_rate": 0.5}}}}
    sets = question_sets(run, n=10)
    # the RL drew only the questions solved at most half the time; the others it never saw
    assert {q.id for q in sets["pool"]} == {q for q, r in rates.items() if r <= 0.5}
    assert sets["unseen"] and not {q.id for q in sets["unseen"]} & set(rates)
    # without the setting, every learnable question of the pool
    run["stage34"]["settings"]["rl"] = {}
    assert {q.id for q in question_sets(run, n=10)["pool"]} == set(rates)
