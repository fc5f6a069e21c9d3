"""`prorag report`: runs of the same world pooled as seeds (per-question averages), paired comparisons over the
pooled seeds, ProRAG's F1 against beta, RL curves from the jobs' journals, Markdown + JSON + PNG."""

import json
import subprocess
import sys

import pytest

from prorag.errors import InvalidArgument
from prorag_app.cli import main as cli_main
from prorag_app.report import build_report, cross_run_difference


def _run(root, name, f1s: dict, beta=0.3, world="default", job_ids=None, rl=None, draw=None):
    """A run directory as `prorag run` leaves it: results.json and each method's predictions.jsonl.
    f1s: method -> [F1 per question]; question i has 1 + i % 4 hops; draw: the records carry question texts of
    that draw of the split (None: no texts, as older runs)."""
    d = root / name
    for method, values in f1s.items():
        (d / method).mkdir(parents=True)
        rows = [{"id": f"q{i}", "hops": 1 + i % 4, "type": "compositional", "f1": f, "em": float(f == 1.0),
                 "acc": float(f == 1.0), **({"question": f"question {i} of draw {draw}"} if draw is not None else {})}
                for i, f in enumerate(values)]
        (d / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {"world": world, "methods": {m: {} for m in f1s},
               "stage34": {"settings": {"beta": beta, "rl": rl or {}}, "jobs": job_ids or {}}}
    (d / "results.json").write_text(json.dumps(results))
    return d


def test_seeds_are_pooled_per_question_and_compared_in_pairs(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_RUNS", str(tmp_path / "runs"))
    journal = tmp_path / "runs" / "jobs" / "rl-job" / "run" / "iterations.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text("".join(json.dumps({"iteration": i, "questions": 16, "f1_mean": 0.1 * i, "reward_mean": i})
                               + "\n" for i in range(3)))
    n = 40
    a = _run(tmp_path, "seed1", {"sft": [0.0] * n, "prorag": [1.0] * n}, beta=0.3, job_ids={"prorag": "rl-job"})
    b = _run(tmp_path, "seed2", {"sft": [0.0] * n, "prorag": [1.0 if i % 2 else 0.0 for i in range(n)]}, beta=0.3)
    # a beta sweep's run: its ProRAG is another method, not a third seed of the headline one
    c = _run(tmp_path, "beta0.5", {"prorag": [0.5] * n}, beta=0.5, job_ids={"prorag": "rl-job"})
    report = build_report([a, b, c], tmp_path / "out")

    assert report["seeds"] == {"sft": 2, "prorag": 2, "prorag[beta=0.5]": 1}
    assert report["methods"]["prorag[beta=0.5]"]["overall"]["f1"] == pytest.approx(0.5)
    # per question: seed 1 always right, seed 2 right on odd questions -> mean 0.75
    assert report["methods"]["prorag"]["overall"]["f1"] == pytest.approx(0.75)
    assert report["methods"]["sft"]["overall"]["f1"] == 0.0
    c = report["comparisons"]["prorag_vs_sft"]
    three_plus = sum(1 + i % 4 >= 3 for i in range(n))
    assert c["seeds"] == 2 and c["n"] == three_plus and c["f1_diff"] == pytest.approx(0.75)
    assert c["ci"][0] > 0  # every question ahead or tied, half of them by a full point
    # ProRAG's 3+ hop F1 per beta (at 0.3 the two seeds' mean: 1.0 and 0.5)
    assert report["beta"] == {
        "0.3": {"f1_3plus_mean": 0.75, "runs": 2, "questions": 20, "f1_3plus_sweep_seed": 1.0},
        "0.5": {"f1_3plus_mean": 0.5, "runs": 1, "questions": 20, "f1_3plus_sweep_seed": 0.5}}
    assert report["rl_curves"]["prorag"] == [[{"questions": 16, "f1": 0.0, "reward": 0.0},
                                              {"questions": 32, "f1": 0.1, "reward": 1.0},
                                              {"questions": 48, "f1": 0.2, "reward": 2.0}]]
    # the beta run's curve is named by its beta, as its method is, not pooled with the headline's
    assert len(report["rl_curves"]["prorag[beta=0.5]"]) == 1
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| prorag | 2 | 75.0 [" in md and "prorag_vs_sft" in md and "| 0.5 | 50.0 | 50.0 | 1 | 20 |" in md
    assert "| prorag[beta=0.5] | 1 | 50.0 [" in md
    for name in ("f1_by_hops", "rl_curves", "beta"):
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "report.json").read_text())["seeds"]["prorag"] == 2


def test_runs_of_other_worlds_or_unfinished_runs_are_refused(tmp_path):
    a = _run(tmp_path, "a", {"sft": [1.0]})
    b = _run(tmp_path, "b", {"sft": [1.0]}, world="s1")
    with pytest.raises(InvalidArgument, match="different worlds"):
        build_report([a, b], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="no results.json"):
        build_report([tmp_path / "empty"], tmp_path / "out")


def test_stage34_seed_and_beta_replace_the_profiles_and_change_the_jobs():
    from prorag_app.profiles import PROFILES, with_stage34

    base = PROFILES["default"]
    assert with_stage34(base) is base
    other = with_stage34(base, seed=7, beta=0.5)
    assert other.stage34["beta"] == 0.5 and base.stage34["beta"] == 0.3
    for job in ("rft", "rl", "dpo"):
        assert other.stage34[job]["seed"] == 7 and base.stage34[job]["seed"] == 1
    assert other.stage34["rl"]["iterations"] == base.stage34["rl"]["iterations"]  # the rest as the profile says


def test_comparisons_also_pool_the_deep_split_where_a_run_evaluated_it(tmp_path):
    n = 8
    run = _run(tmp_path, "seed1", {"sft": [0.0] * n, "prorag": [1.0] * n})
    for method, f1 in (("sft", 0.0), ("prorag", 0.5)):
        (run / "deep" / method).mkdir(parents=True)
        rows = [{"id": f"test_deep_{i}", "hops": 3, "type": "compositional", "f1": f1, "em": 0.0, "acc": 0.0}
                for i in range(10)]
        (run / "deep" / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report([run], tmp_path / "out")
    c = report["comparisons"]["prorag_vs_sft"]
    three_plus = sum(1 + i % 4 >= 3 for i in range(n))
    assert c["n"] == three_plus + 10
    assert c["f1_diff"] == pytest.approx((three_plus * 1.0 + 10 * 0.5) / (three_plus + 10))
    # the per-method table stays the test split's
    assert report["methods"]["prorag"]["overall"]["n"] == n


def _heldout(run, f1s: dict, n: int = 12) -> None:
    for method, f1 in f1s.items():
        (run / "heldout" / method).mkdir(parents=True)
        rows = [{"id": f"heldout_deep_{i}", "hops": 3 + i % 2, "type": "compositional", "f1": f1(i), "em": 0.0,
                 "acc": 0.0} for i in range(n)]
        (run / "heldout" / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_heldout_split_is_compared_on_its_own_and_the_claim_is_read_there(tmp_path):
    n = 8
    runs = [_run(tmp_path, f"seed{k}", {"sft": [0.0] * n, "outcome_grpo": [1.0] * n}) for k in (1, 2)]
    _heldout(runs[0], {"sft": lambda i: 0.5, "outcome_grpo": lambda i: 0.25})
    report = build_report(runs[:1], tmp_path / "one")
    held = report["comparisons_heldout"]["outcome_grpo_vs_sft"]
    # the held-out questions alone: the test split's (where outcome GRPO wins) do not enter
    assert held["n"] == 12 and held["f1_diff"] == pytest.approx(-0.25)
    assert report["comparisons"]["outcome_grpo_vs_sft"]["f1_diff"] == pytest.approx(1.0)
    assert report["claim"]["read_on"] == "heldout"
    assert report["claim"]["links"][0] == {**report["claim"]["links"][0], "status": "reversed", "diff": held["f1_diff"]}
    md = (tmp_path / "one" / "report.md").read_text()
    assert "held-out split, read once" in md and "Read on the held-out split." in md
    # a run without it: the held-out comparison is not pooled over the runs that have one, and the claim is the
    # test split's
    report = build_report(runs, tmp_path / "two")
    assert "comparisons_heldout" not in report and report["claim"]["read_on"] == "test"
    assert report["claim"]["links"][0]["status"] == "holds"


def test_data_efficiency_reads_the_rl_adapters_evaluated_after_some_iterations(tmp_path):
    n = 40
    deep = [i for i in range(n) if 1 + i % 4 >= 3]  # 20 questions of 3+ hops; the others do not count

    def f1s(value_3plus):
        return [value_3plus if i in deep else 0.9 for i in range(n)]

    rl = {"seed": 1, "iterations": 10, "questions_per_iteration": 16}
    first = _run(tmp_path, "seed1", {"sft": f1s(0.1), "outcome_grpo@it3": f1s(0.2), "outcome_grpo": f1s(0.3),
                                     "prorag@it3": f1s(0.25), "prorag@it5": f1s(0.35), "prorag": f1s(0.4)}, rl=rl)
    second = _run(tmp_path, "seed2", {"sft": f1s(0.1), "outcome_grpo": f1s(0.0), "prorag": f1s(0.0)},
                  rl={**rl, "seed": 2})
    eff = build_report([first, second], tmp_path / "out")["data_efficiency"]
    # only the run that evaluated earlier adapters counts, so the finals are that run's, like for like
    assert eff["runs"] == 1
    assert ([(p["questions"], pytest.approx(p["f1"])) for p in eff["curves"]["outcome_grpo"]]
            == [(0, 0.1), (48, 0.2), (160, 0.3)])  # from the SFT model it started from
    assert [p["questions"] for p in eff["curves"]["prorag"]] == [48, 80, 160]  # no RFT model in this run
    assert eff["outcome_grpo_final_f1"] == pytest.approx(0.3) and eff["outcome_grpo_questions"] == 160
    assert eff["prorag_reaches_at"] == 80  # 0.35 after 5 iterations of 16 questions
    md = (tmp_path / "out" / "report.md").read_text()
    assert "ProRAG reaches it after 80 questions (0.50 of them)" in md and "shows no learning" not in md

    behind = _run(tmp_path, "behind", {"outcome_grpo@it3": f1s(0.2), "outcome_grpo": f1s(0.5),
                                       "prorag@it3": f1s(0.1), "prorag": f1s(0.4)}, rl=rl)
    eff = build_report([behind], tmp_path / "out2")["data_efficiency"]
    assert eff["prorag_reaches_at"] is None
    assert "at none of its evaluated points" in (tmp_path / "out2" / "report.md").read_text()

    # outcome GRPO ending below where it started: ProRAG "reaching" that is no evidence, and the report says so
    down = _run(tmp_path, "down", {"sft": f1s(0.3), "rft": f1s(0.3), "outcome_grpo@it3": f1s(0.25),
                                   "outcome_grpo": f1s(0.2), "prorag@it3": f1s(0.2), "prorag": f1s(0.1)}, rl=rl)
    eff = build_report([down], tmp_path / "out3")["data_efficiency"]
    assert eff["prorag_reaches_at"] == 48 and eff["outcome_grpo_start_f1"] == pytest.approx(0.3)
    assert eff["curves"]["prorag"][0] == {"questions": 0, "f1": pytest.approx(0.3)}  # from the RFT model
    assert "shows no learning" in (tmp_path / "out3" / "report.md").read_text()


def test_data_efficiency_counts_the_deep_split_where_every_point_was_evaluated_on_it(tmp_path):
    n = 8  # questions 2, 3, 6, 7 of the test split have 3+ hops
    rl = {"seed": 1, "iterations": 10, "questions_per_iteration": 16}
    test = {"sft": [0.0] * n, "outcome_grpo@it3": [0.0] * n, "outcome_grpo": [0.0] * n,
            "rft": [0.0] * n, "prorag@it3": [0.0] * n, "prorag": [0.0] * n}
    deep = {"sft": 0.0, "outcome_grpo@it3": 1.0, "outcome_grpo": 0.5, "rft": 0.0, "prorag@it3": 0.5, "prorag": 1.0}

    def with_deep(name, methods):
        run = _run(tmp_path, name, test, rl=rl)
        for method in methods:
            (run / "deep" / method).mkdir(parents=True)
            rows = [{"id": f"test_deep_{i}", "hops": 3, "type": "compositional", "f1": deep[method], "em": 0.0,
                     "acc": 0.0} for i in range(12)]
            (run / "deep" / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run

    eff = build_report([with_deep("all", deep)], tmp_path / "out")["data_efficiency"]
    assert eff["questions"] == 4 + 12
    assert [(p["questions"], pytest.approx(p["f1"])) for p in eff["curves"]["outcome_grpo"]] == [
        (0, 0.0), (48, 12 / 16), (160, 6 / 16)]
    assert eff["prorag_reaches_at"] == 48  # 6/16 after 3 iterations, as much as outcome GRPO's final
    assert "on 16 questions of 3+ hops" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "data_efficiency.png").stat().st_size > 1000
    # an earlier adapter not evaluated on the deep split: the run's points use the test split alone
    eff = build_report([with_deep("finals_only", ["sft", "outcome_grpo", "rft", "prorag"])],
                       tmp_path / "out2")["data_efficiency"]
    assert eff["questions"] == 4 and all(p["f1"] == 0.0 for p in eff["curves"]["outcome_grpo"])


def test_claim_links_name_the_first_link_that_does_not_hold():
    from prorag_app.report import claim_links

    def comp(lo, hi, seeds=True):
        return {"f1_diff": (lo + hi) / 2, "ci": [lo - 0.01, hi + 0.01],
                **({"ci_seeds_questions": [lo, hi]} if seeds else {}), "seeds": 3 if seeds else 1}

    comparisons = {"outcome_grpo_vs_sft": comp(0.01, 0.05), "prorag_oracle_vs_outcome_grpo": comp(-0.02, 0.03),
                   "prorag_no_rft_vs_outcome_grpo": comp(-0.06, -0.02, seeds=False)}
    out = claim_links(comparisons, [{"passed": True, "reasons": []}, {"passed": False, "reasons": ["AUC 0.5 < 0.8"]}])
    status = {lk["link"]: lk["status"] for lk in out["links"]}
    assert list(status.values()) == ["holds", "not shown", "fails", "reversed"]
    assert out["first_failed"] == "the oracle's step credit helps"
    # the seed-and-question interval is read where there is one, the question one otherwise
    assert out["links"][0]["ci"] == [0.01, 0.05] and out["links"][0]["ci_includes_seeds"]
    assert out["links"][3]["ci"] == pytest.approx([-0.07, -0.01]) and not out["links"][3]["ci_includes_seeds"]
    assert out["links"][2]["reasons"] == ["AUC 0.5 < 0.8"]
    # a chain with every link above 0 and a passed gate holds; missing comparisons are "not run"
    good = {k: comp(0.01, 0.02) for k in comparisons}
    assert claim_links(good, [{"passed": True}])["first_failed"] is None
    missing = claim_links({}, [])
    assert {lk["status"] for lk in missing["links"]} == {"not run"} and missing["first_failed"] == "RL learns"


def test_the_report_says_whether_its_stage_2_4_figures_are_a_demonstration_or_the_research_experiment(tmp_path):
    from prorag_app.report import budget_note

    assert "demonstrations at `make run`'s budget" in budget_note(["default"])
    assert "demonstrations" in budget_note(["ablation/seed1", "ablation/seed2"])
    assert budget_note(["research/seed1", "research/seed2"]).startswith("The research profile's experiment")
    assert budget_note(["mine"]) == "Runs of profiles mine."
    run = _run(tmp_path, "seed1", {"sft": [0.0] * 4})
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "profile": "default"}))
    report = build_report([run], tmp_path / "out")
    assert "demonstrations" in report["budget"] and report["budget"] in (tmp_path / "out" / "report.md").read_text()


def test_cross_run_difference_pairs_each_side_s_runs_as_seeds(tmp_path):
    n = 40  # questions 2, 3, 6, 7, ... have 3+ hops: 20 of them
    deep = [i for i in range(n) if 1 + i % 4 >= 3]
    a1 = _run(tmp_path, "a1", {"sft": [0.0] * n, "outcome_grpo": [1.0] * n}, draw=0)
    a2 = _run(tmp_path, "a2", {"sft": [0.0] * n, "outcome_grpo": [0.5] * n}, draw=0)
    b1 = _run(tmp_path, "b1", {"sft": [0.0] * n, "outcome_grpo": [0.5 if i in deep[:10] else 0.0 for i in range(n)]},
              draw=0)
    b2 = _run(tmp_path, "b2", {"sft": [0.0] * n, "outcome_grpo": [0.0] * n}, draw=0)
    r = cross_run_difference([a1, a2], [b1, b2], "outcome_grpo", "outcome_grpo")
    # per question, A's seeds average 0.75; B's 0.25 on half the 3+ hop questions, 0 on the others
    assert (r["n"], r["seeds"]) == (20, 2) and r["f1_diff"] == pytest.approx(0.75 - 0.125)
    assert (r["a_mean"], r["b_mean"]) == (pytest.approx(0.75), pytest.approx(0.125))
    assert r["wins"] == 20 and r["ci"][0] > 0 and r["ci_seeds_questions"] is not None
    # a method against another across runs: A's RL against B's SFT, one seed
    one = cross_run_difference([a1], [b1], "outcome_grpo", "sft", min_hops=1)
    assert (one["n"], one["f1_diff"], one["ci_seeds_questions"]) == (40, 1.0, None)
    assert (one["a"], one["b"], one["runs_a"]) == ("outcome_grpo", "sft", [str(a1)])


def test_cross_run_difference_refuses_what_cannot_be_paired(tmp_path):
    a = _run(tmp_path, "a", {"sft": [0.0] * 8}, draw=0)
    redrawn = _run(tmp_path, "redrawn", {"sft": [1.0] * 8}, draw=1)
    with pytest.raises(InvalidArgument, match="1 run.s. against 2"):
        cross_run_difference([a], [a, a], "sft", "sft")
    with pytest.raises(InvalidArgument, match="no predictions of 'outcome_grpo'"):
        cross_run_difference([a], [a], "outcome_grpo", "sft")
    # the same ids naming other questions: a world whose drawn splits were redrawn between the runs
    with pytest.raises(InvalidArgument, match=r"different questions under the same ids \(8 answers, e.g. q0: "
                                              r"'question 0 of draw 0'"):
        cross_run_difference([a], [redrawn], "sft", "sft")
    with pytest.raises(InvalidArgument, match="different questions under the same ids"):
        build_report([a, redrawn], tmp_path / "out")


def test_prorag_compare_prints_the_paired_difference(tmp_path, capsys):
    n = 8
    a = _run(tmp_path, "a", {"outcome_grpo": [1.0] * n}, draw=0)
    b = _run(tmp_path, "b", {"outcome_grpo": [0.0] * n}, draw=0)
    assert cli_main(["compare", str(a), str(b), "--min-hops", "1"]) == 0
    out = capsys.readouterr().out
    assert "outcome_grpo (1 run(s)) - outcome_grpo (1 run(s)), 1+ hops, 8 questions: +100.0 F1" in out
    assert "wins/losses/ties 8/0/0" in out
    assert cli_main(["compare", str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 4  # questions 2, 3, 6, 7 have 3+ hops
    assert cli_main(["compare", str(a), f"{a},{b}"]) == 2  # a caller's mistake: said, no traceback
    assert "give as many on each side" in capsys.readouterr().err


def test_the_report_reads_runs_without_loading_torch_or_the_trainer():
    """`prorag report` and `prorag compare` read run directories on any laptop: importing the report must not load
    torch (seconds, and gigabytes where a CUDA build is installed) nor the trainer's stages."""
    code = ("import sys, prorag_app.report\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('services.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
