"""prorag.evaluation: scoring groups (per hop, per type, 2+ hops), the figure's margin test, grouped CIs."""

import pytest

from prorag.evaluation import grouped_mean_ci, margin_beyond_cis, score_records
from prorag.metrics import summarize


def _records(spec):
    """spec: [(hops, type, f1)] -> records as run_agent/run_baseline produce them (em = f1 == 1)."""
    return [{"hops": h, "type": t, "f1": f, "em": float(f == 1.0)} for h, t, f in spec]


def test_multi_hop_groups_every_question_of_two_or_more_hops_and_nothing_else():
    recs = _records([(1, "compositional", 1.0), (1, "compositional", 1.0), (2, "compositional", 0.5),
                     (2, "comparison", 0.0), (3, "compositional", 1.0), (4, "bridge_comparison", 0.0)])
    s = score_records(recs)
    assert s["multi_hop"]["n"] == 4
    assert s["multi_hop"]["f1"] == pytest.approx(1.5 / 4)
    assert s["multi_hop"]["em"] == pytest.approx(1 / 4)
    lo, hi = s["multi_hop"]["f1_ci"]
    assert 0.0 <= lo <= s["multi_hop"]["f1"] <= hi <= 1.0
    assert s["overall"]["n"] == 6 and set(s["by_hops"]) == {"1", "2", "3", "4"}


def test_multi_hop_is_none_when_the_split_has_only_one_hop_questions():
    assert score_records(_records([(1, "compositional", 1.0), (1, "compositional", 0.0)]))["multi_hop"] is None


def test_margin_must_exceed_the_width_of_both_intervals_and_they_must_not_overlap():
    a = {"f1": 0.30, "f1_ci": [0.25, 0.35]}
    clear = margin_beyond_cis(a, {"f1": 0.10, "f1_ci": [0.06, 0.14]})
    assert clear["reached"] and not clear["cis_overlap"]
    assert clear["margin"] == pytest.approx(0.20) and clear["better_ci_width"] == pytest.approx(0.10)
    # overlapping intervals: not reached although the means differ
    assert not margin_beyond_cis(a, {"f1": 0.22, "f1_ci": [0.18, 0.26]})["reached"]
    # no overlap, but a wide baseline interval is larger than the margin: not reached either
    wide = margin_beyond_cis(a, {"f1": 0.15, "f1_ci": [0.0, 0.24]})
    assert not wide["cis_overlap"] and not wide["reached"]
    # worse than the baseline is never reached
    assert not margin_beyond_cis({"f1": 0.1, "f1_ci": [0.09, 0.11]}, a)["reached"]


def test_acc_is_reported_beside_em_and_f1_when_every_record_has_it():
    recs = [{"hops": 1, "type": "compositional", "em": 0.0, "f1": 0.5, "acc": 1.0},
            {"hops": 1, "type": "compositional", "em": 1.0, "f1": 1.0, "acc": 1.0}]
    assert score_records(recs)["overall"]["acc"] == 1.0
    assert "acc" not in score_records(_records([(1, "compositional", 1.0)]))["overall"]


def test_grouped_means_use_the_one_mean_with_ci_helper():
    out = grouped_mean_ci([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], seed=3)
    assert out["overall"] == summarize([1.0, 0.0, 1.0, 1.0], seed=3)
    assert out["a"]["mean"] == 0.5 and out["b"] == {"n": 2, "mean": 1.0, "ci": [1.0, 1.0]}
