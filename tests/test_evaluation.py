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


# ---------------------------------------------------------------- paired method comparisons (issue 19)
def test_paired_difference_is_the_mean_per_question_difference_with_a_ci_around_it():
    from prorag.evaluation import paired_difference

    a = [[1.0, 1.0, 0.5, 0.0, 1.0, 0.8]]
    b = [[0.0, 1.0, 0.5, 0.0, 0.5, 0.8]]
    r = paired_difference(a, b)
    assert r["f1_diff"] == pytest.approx(1.5 / 6)
    assert r["n"] == 6 and r["seeds"] == 1 and (r["wins"], r["losses"], r["ties"]) == (2, 0, 4)
    lo, hi = r["ci"]
    assert 0.0 <= lo <= r["f1_diff"] <= hi <= 1.0


def test_pairing_removes_the_spread_between_questions_that_unpaired_intervals_keep():
    """A is B plus 0.05 on every question while questions range from 0 to 1: the paired CI is a point above 0,
    while the two per-method intervals overlap widely."""
    from prorag.evaluation import paired_difference

    b = [[i / 99 * 0.9 for i in range(100)]]
    a = [[x + 0.05 for x in b[0]]]
    r = paired_difference(a, b)
    assert r["ci"][0] == pytest.approx(0.05) and r["ci"][1] == pytest.approx(0.05)
    ca, cb = summarize(a[0])["ci"], summarize(b[0])["ci"]
    assert ca[0] < cb[1]  # unpaired: overlapping


def test_seeds_are_averaged_per_question_before_resampling():
    from prorag.evaluation import paired_difference

    r = paired_difference([[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]])
    # per question: (1 - 0 + 0 - 0) / 2 = 0.5 and (0 - 0 + 0 - 1) / 2 = -0.5
    assert r["f1_diff"] == pytest.approx(0.0) and r["seeds"] == 2 and (r["wins"], r["losses"]) == (1, 1)
    with pytest.raises(ValueError):
        paired_difference([[1.0]], [[1.0, 0.0]])
    with pytest.raises(ValueError):
        paired_difference([[]], [[]])


def test_compare_methods_keeps_the_group_and_the_questions_every_run_answered():
    from prorag.evaluation import compare_methods

    hops = {"q1": 1, "q2": 3, "q3": 4, "q4": 3}
    per_q = {"prorag": [{"q1": 0.0, "q2": 1.0, "q3": 1.0, "q4": 0.5}],
             "sft": [{"q1": 1.0, "q2": 0.0, "q3": 1.0}]}  # q4 missing from sft: not compared
    out = compare_methods(per_q, hops, [("prorag", "sft"), ("prorag", "outcome_grpo")])
    assert set(out) == {"prorag_vs_sft"}  # outcome_grpo was not run
    c = out["prorag_vs_sft"]
    assert c["group"] == "3+ hops" and c["n"] == 2 and c["f1_diff"] == pytest.approx(0.5)
    assert (c["a"], c["b"]) == ("prorag", "sft")


def test_the_seed_and_question_interval_carries_training_noise_that_the_question_interval_leaves_out():
    from prorag.evaluation import paired_difference

    # two seeds of one comparison that disagree: A wins every question by 0.5 in seed 0 and loses every one by
    # 0.4 in seed 1 (training noise); averaged over the seeds each question differs by +0.05
    a = [[0.5] * 40, [0.0] * 40]
    b = [[0.0] * 40, [0.4] * 40]
    r = paired_difference(a, b, n_resamples=4000)
    assert r["f1_diff"] == pytest.approx(0.05) and r["ci_includes_seeds"] is False
    assert r["ci"] == pytest.approx([0.05, 0.05])  # the question bootstrap sees no spread at all
    lo, hi = r["ci_seeds_questions"]
    # resampled seeds: both seed 0 twice (+0.5) and seed 1 twice (-0.4) occur, so the interval spans them
    assert lo == pytest.approx(-0.4) and hi == pytest.approx(0.5)
    one_seed = paired_difference([[0.5, 0.0]], [[0.0, 0.0]])
    assert one_seed["ci_seeds_questions"] is None


def test_seed_question_bootstrap_matches_the_question_bootstrap_when_seeds_agree():
    import numpy as np

    from prorag.metrics import bootstrap_ci, seed_question_bootstrap_ci

    rng = np.random.default_rng(3)
    per_question = rng.normal(0.1, 0.3, size=200)
    same = np.stack([per_question, per_question, per_question])  # three seeds, identical runs
    lo, hi = seed_question_bootstrap_ci(same, n_resamples=3000, seed=1)
    qlo, qhi = bootstrap_ci(per_question, n_resamples=3000, seed=1)
    assert abs(lo - qlo) < 0.02 and abs(hi - qhi) < 0.02
    with pytest.raises(ValueError, match="non-empty"):
        seed_question_bootstrap_ci(np.zeros((2, 0)))
