"""prorag_app.diagnose: which questions `prorag diagnose rl` reads as the RL's own; `prorag diagnose errors` on
hand-written runs of the tiny world."""

from __future__ import annotations

import json

import pytest

from prorag import paths
from prorag.data.loaders import load_split
from prorag.diagnosis import gold_chain
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag_app.cli import main
from prorag_app.diagnose import error_diagnosis, question_sets
from prorag_app.embedded import ensure_world
from prorag_app.report import build_report


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


def _record(q, f1, steps, finish="answer", text=None):
    return {"id": q.id, "question": text or q.question, "golden_answers": q.golden_answers, "hops": q.metadata["hops"],
            "type": q.metadata["type"], "em": f1, "acc": f1,
            "f1": f1, "finish_reason": finish, "trajectory": {"question_id": q.id, "steps": steps}}


def chain(q):
    return gold_chain(q.metadata)


def first_hop(q):
    hop = chain(q)[0]
    return [{"kind": "STEP_KIND_SUBQUERY", "content": hop["question"],
             "retrieved": [{"document": {"id": hop["doc_id"], "text": "..."}}]},
            {"kind": "STEP_KIND_SUBANSWER", "content": hop["answer"]}]


def _write_run(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps({"world": "tiny", "split": "dev", "methods": {
        m: {} for m in records}}))
    for m, recs in records.items():
        (run_dir / m).mkdir(exist_ok=True)
        (run_dir / m / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_error_diagnosis_reads_each_models_errors_along_the_gold_chains_and_what_rl_fixed(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    ensure_world("tiny")
    dev = load_split(paths.world_dir("tiny"), "dev")
    deep = [q for q in dev if q.metadata["hops"] >= 2][:3]
    shallow = next(q for q in dev if q.metadata["hops"] == 1)
    assert len(deep) == 3, "the tiny world's dev split has 2+ hop questions"
    a, b, c = deep
    answer = [{"kind": "STEP_KIND_ANSWER", "content": "x"}]
    records = {
        "sft": [_record(a, 1.0, []), _record(b, 0.0, first_hop(b) + answer),
                _record(c, 0.0, first_hop(c), finish="invalid_format"), _record(shallow, 0.0, [])],
        "outcome_grpo": [_record(a, 0.0, first_hop(a) + answer), _record(b, 1.0, []),
                         _record(c, 0.0, first_hop(c), finish="invalid_format"), _record(shallow, 1.0, [])]}
    _write_run(tmp_path / "run", records)
    report = error_diagnosis(tmp_path / "run", min_hops=2)
    # the 1-hop question is left out; each model's kinds count its three questions
    sft, rl = report["methods"]["sft"], report["methods"]["outcome_grpo"]
    assert sft["n"] == rl["n"] == 3
    assert {k: n for k, n in sft["counts"].items() if n} == {"right": 1, "early_answer": 1, "broke_format": 1}
    assert {k: n for k, n in rl["counts"].items() if n} == {"right": 1, "early_answer": 1, "broke_format": 1}
    # the same shares, yet RL fixed one early answer and made another
    moved = report["transitions"]["outcome_grpo"]
    assert moved["early_answer"]["right"] == moved["right"]["early_answer"] == 1
    assert moved["broke_format"]["broke_format"] == 1
    assert json.loads((tmp_path / "run" / "errors.json").read_text()) == report
    assert error_diagnosis(tmp_path / "run", min_hops=1)["methods"]["sft"]["n"] == 4


def test_prorag_diagnose_errors_prints_the_report_as_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    ensure_world("tiny")
    q = next(q for q in load_split(paths.world_dir("tiny"), "dev") if q.metadata["hops"] >= 2)
    _write_run(tmp_path / "run", {"sft": [_record(q, 0.0, first_hop(q), finish="invalid_format")],
                                  "outcome_grpo": [_record(q, 1.0, [])]})
    assert main(["diagnose", "errors", str(tmp_path / "run"), "--min-hops", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["methods"]["sft"]["counts"]["broke_format"] == 1
    assert report["transitions"]["outcome_grpo"]["broke_format"]["right"] == 1


def test_error_diagnosis_refuses_what_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    ensure_world("tiny")
    q = next(q for q in load_split(paths.world_dir("tiny"), "dev") if q.metadata["hops"] >= 2)
    with pytest.raises(InvalidArgument, match="min-hops"):
        error_diagnosis(tmp_path, min_hops=0)
    with pytest.raises(InvalidArgument, match="no results.json"):
        error_diagnosis(tmp_path / "nowhere")
    # a question redrawn under its id since the run: its chain is another question's
    _write_run(tmp_path / "redrawn", {"sft": [_record(q, 0.0, [], text="Who wrote something else?")]})
    with pytest.raises(FailedPrecondition, match="redrawn"):
        error_diagnosis(tmp_path / "redrawn", min_hops=1)
    # a run that kept no trajectory of a question deep enough
    _write_run(tmp_path / "shallow", {"sft": [_record(q, 0.0, [])]})
    with pytest.raises(FailedPrecondition, match="no trajectory"):
        error_diagnosis(tmp_path / "shallow", min_hops=9)


def test_the_report_counts_each_method_s_errors_over_its_seeds(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    ensure_world("tiny")
    deep = [q for q in load_split(paths.world_dir("tiny"), "dev") if q.metadata["hops"] >= 3][:2]
    a, b = deep
    answer = [{"kind": "STEP_KIND_ANSWER", "content": "x"}]
    _write_run(tmp_path / "s1", {"sft": [_record(a, 1.0, []), _record(b, 0.0, first_hop(b) + answer)]})
    _write_run(tmp_path / "s2", {"sft": [_record(a, 0.0, first_hop(a), finish="invalid_format"),
                                         _record(b, 0.0, first_hop(b) + answer)]})
    report = build_report([tmp_path / "s1", tmp_path / "s2"], tmp_path / "out")
    assert report["errors"]["sft"]["n"] == 4  # two questions of 3+ hops in each seed
    assert {k: n for k, n in report["errors"]["sft"]["counts"].items() if n} == {
        "right": 1, "early_answer": 2, "broke_format": 1}
    assert "## Why answers are wrong" in (tmp_path / "out" / "report.md").read_text()
    assert "id=errors-table" in (tmp_path / "s1" / "report" / "index.html").read_text()
