"""prorag_app.stage2 with the siblings job: which jobs stage 2 submits, with what pairs the PRM trains (the MCTS
pairs, the sibling pairs, or both), the counts per step kind it reports, and its settings' checks.

The trainer is a recorder (the stage 3-4 tests' way): it keeps each submitted job and answers with the metrics and
outputs the real stages return, the per-kind counts made by the stages' own functions."""

from __future__ import annotations

import pytest

from prorag.config import ConfigError, from_dict
from prorag.search.pairs import StepPair
from prorag.trajectory import Step
from prorag_app.stage2 import counts_by_kind, run_stage2, siblings_job_id
from prorag_app.stage_settings import Stage2Settings
from prorag_app.trainer_jobs import settings_job_id
from services.trainer.stage_mcts import PAIRS_VERSION, flat_counts, pair_counts


class _Stack:
    def grpc_target(self, name):
        return f"127.0.0.1:{ {'retriever': 1, 'judge': 4, 'trainer': 5}[name] }"


class _PRMSubmitted(Exception):
    """Raised by the recorder at the prm job: what follows (the validation) needs a real PRM."""


def _pairs(kinds_labels):
    return [StepPair("q", "Q?", [], (Step(k, content="a"), Step(k, content="b")), judge_choice=label,
                     meta={"step_kind": k}) for k, label in kinds_labels]


def _recorder(tmp_path, mcts_judged=1, siblings_judged=2):
    submitted = []
    made = {"mcts": _pairs([("subquery", 0)] * mcts_judged + [("subanswer", None)]),
            "siblings": _pairs([("subanswer", 1)] * siblings_judged + [("answer|subquery", None)])}

    def run_job(stack, stage, config, job_id, before_start=None):
        if before_start is not None:  # as the real one does when it submits a job (every one here)
            before_start()
        submitted.append((stage, config, job_id))
        if stage == "prm":
            raise _PRMSubmitted
        pairs = made[stage]
        counts = pair_counts(pairs)
        metrics = {"questions": 1, "pairs": len(pairs), "judge_labelled": sum(c["judge_labelled"]
                                                                              for c in counts.values()),
                   "value_labelled": 0, **flat_counts(counts)}
        return {"job_id": job_id, "metrics": metrics, "outputs": {"pairs_path": str(tmp_path / job_id / "pairs.jsonl")},
                "run_dir": str(tmp_path / job_id)}

    return run_job, submitted


def _run(tmp_path, monkeypatch, settings, **kw):
    from prorag_app import stage2

    run_job, submitted = _recorder(tmp_path, **kw)
    monkeypatch.setattr(stage2, "run_job", run_job)
    s = from_dict(Stage2Settings, settings)
    try:
        out = run_stage2(_Stack(), "127.0.0.1:2", "w", "sft@a", {"topk": 1}, s, tmp_path / "run", "w-stage2", {})
    except _PRMSubmitted:
        out = None
    return out, submitted


def test_without_siblings_settings_the_prm_trains_on_the_mcts_pairs_alone(tmp_path, monkeypatch):
    _, submitted = _run(tmp_path, monkeypatch, {"mcts": {"max_questions": 5}})
    assert [s for s, _, _ in submitted] == ["mcts", "prm"]
    mcts_cfg, mcts_id = submitted[0][1], submitted[0][2]
    # the pair rule's version is part of the id: trees paired by the old rule are not reused
    assert mcts_id == settings_job_id("w-stage2", "mcts", mcts_cfg, {"pairs": PAIRS_VERSION})
    assert mcts_id != settings_job_id("w-stage2", "mcts", mcts_cfg)
    prm_cfg = submitted[1][1]
    assert prm_cfg["pairs"].endswith(f"{mcts_id}/pairs.jsonl") and "extra_pairs" not in prm_cfg


def test_siblings_pairs_join_the_mcts_pairs_and_each_choice_is_its_own_prm_job(tmp_path, monkeypatch):
    sib = {"max_questions": 50, "samples": 4}
    _, both = _run(tmp_path, monkeypatch, {"siblings": sib})
    assert [s for s, _, _ in both] == ["mcts", "siblings", "prm"]
    sib_cfg, sib_id = both[1][1], both[1][2]
    # the siblings job samples the SFT agent through the same services, with the profile's settings
    assert sib_cfg["policy"] == "127.0.0.1:2" and sib_cfg["judge"] == "127.0.0.1:4" and sib_cfg["topk"] == 1
    assert sib_cfg["policy_model"] == "sft@a" and sib_cfg["max_questions"] == 50 and sib_cfg["samples"] == 4
    prm_cfg = both[2][1]
    assert prm_cfg["pairs"].endswith(f"{both[0][2]}/pairs.jsonl")
    assert prm_cfg["extra_pairs"].endswith(f"{sib_id}/pairs.jsonl")
    _, only = _run(tmp_path, monkeypatch, {"siblings": sib, "prm_pairs": "siblings"})
    assert only[2][1]["pairs"].endswith(f"{sib_id}/pairs.jsonl") and "extra_pairs" not in only[2][1]
    _, alone = _run(tmp_path, monkeypatch, {"siblings": sib, "prm_pairs": "mcts"})
    assert "extra_pairs" not in alone[2][1]
    # three different training sets, three PRM jobs; other siblings settings, another siblings job
    assert len({both[2][2], only[2][2], alone[2][2]}) == 3
    _, other = _run(tmp_path, monkeypatch, {"siblings": {**sib, "samples": 6}})
    assert other[1][2] != sib_id and other[0][2] == both[0][2]


def test_a_siblings_job_id_carries_the_version_of_each_sampler_it_uses():
    from services.trainer.stage_siblings import RELATION_VERSION, SIBLINGS_VERSION

    plain = {"max_questions": 50, "reading_samples": 2, "bridge_samples": 2}
    # without relation samples the id is what it was before the relation sampler had a version of its own, so
    # finished jobs that never asked a relation are reused
    assert siblings_job_id("w", plain) == settings_job_id("w", "siblings", plain, {"siblings": SIBLINGS_VERSION})
    relation = {**plain, "relation_samples": 2}
    assert siblings_job_id("w", relation) == settings_job_id(
        "w", "siblings", relation, {"siblings": SIBLINGS_VERSION, "relation": RELATION_VERSION})
    assert siblings_job_id("w", relation) != settings_job_id("w", "siblings", relation, {"siblings": SIBLINGS_VERSION})


def test_stage2_reports_counts_per_kind_and_skips_the_prm_without_labels(tmp_path, monkeypatch):
    out, submitted = _run(tmp_path, monkeypatch, {"siblings": {"max_questions": 5}, "prm_pairs": "siblings"},
                          siblings_judged=0)
    assert [s for s, _, _ in submitted] == ["mcts", "siblings"]  # no judge-labelled sibling pair: no PRM job
    assert "no judge-labelled" in out["skipped"] and "siblings job" in out["skipped"]
    assert out["pairs_by_kind"] == {
        "mcts": {"subanswer": {"pairs": 1, "value_labelled": 0, "judge_labelled": 0},
                 "subquery": {"pairs": 1, "value_labelled": 0, "judge_labelled": 1}},
        "siblings": {"answer|subquery": {"pairs": 1, "value_labelled": 0, "judge_labelled": 0}}}
    assert out["siblings"]["pairs"] == 1 and set(out["jobs"]) == {"mcts", "siblings"}
    # ReasonRAG's DPO data stays the trees' value-labelled pairs
    assert out["pairs_path"].endswith(f"{submitted[0][2]}/pairs.jsonl")


def test_counts_by_kind_reads_the_flat_metrics_back():
    counts = {"answer|subquery": {"pairs": 3, "judge_labelled": 1}, "subanswer": {"pairs": 2, "judge_labelled": 2}}
    assert counts_by_kind({"pairs": 5, **flat_counts(counts)}) == counts
    assert counts_by_kind({"pairs": 5}) == {}


def test_settings_check_the_siblings_job_and_the_pair_choice():
    with pytest.raises(ConfigError, match="siblings.samplez"):
        from_dict(Stage2Settings, {"siblings": {"samplez": 4}})
    with pytest.raises(ConfigError, match="siblings.samples"):
        from_dict(Stage2Settings, {"siblings": {"samples": 0}})
    with pytest.raises(ConfigError, match="prm_pairs"):
        from_dict(Stage2Settings, {"prm_pairs": "siblings"})
    with pytest.raises(ConfigError, match="prm_pairs"):
        from_dict(Stage2Settings, {"prm_pairs": "trees"})
    assert from_dict(Stage2Settings, {}).siblings == {}
