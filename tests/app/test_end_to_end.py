"""The whole pipeline on the tiny profile, as `make run` does it on the default one: world,
indexes, base policy, five services as processes, retrieval evaluation, SFT and the no-retrieval baseline
trained through the trainer service, standard RAG read by the agent, evaluation through policy services, stages
2-4 and the baselines trained from the agent, results.json, and the ablation report in small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorag.data.loaders import load_split
from prorag.diagnosis import SOLVE_RATE_BINS
from prorag.registry import artifact_name
from prorag_app.cli import served_policy
from prorag_app.diagnose import error_diagnosis, run_diagnosis
from prorag_app.embedded import ensure_world
from prorag_app.pipeline import run_ablation, run_main_job
from prorag_app.profiles import AblationPlan
from tests.helpers import free_offset


@pytest.mark.slow
# the whole pipeline twice, then the ablation in small: ~9-10 minutes on 2 quiet cores; the suite's 600 s hang guard
# cut it on a clean clone, so this one test gets a longer guard (a hang still fails it)
@pytest.mark.timeout(1500)
def test_tiny_pipeline_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    monkeypatch.setenv("PRORAG_TRACKING", "local")
    # evaluations are reused only for committed code (prorag_app.memo); a worktree under edit reads as dirty, so
    # the test gives both runs one code identity to see the reuse wherever it runs
    monkeypatch.setattr("prorag_app.memo.code_identity", lambda: "e2e0001")

    # a world other than the profile's, built with another seed: trained and evaluated as it was built
    ensure_world("tiny-s7", size="tiny", seed=7)
    # stages 2-4 sample from two policy processes whatever the machine's cores (the default on 2 cores)
    results = run_main_job(profile="tiny", world="tiny-s7", port_offset=free_offset(), policy_replicas=2)
    assert results["world"] == "tiny-s7" and results["policy_replicas"] == 2
    for stack in ("stage2-policy", "stage34-sft-policy"):
        logs = Path(results["run_dir"]) / "logs" / stack
        assert {p.name for p in logs.iterdir()} >= {"policy.log", "policy-1.log"}, stack
    assert json.loads((tmp_path / "data" / "worlds" / "tiny-s7" / "world.json").read_text())["config"]["seed"] == 7

    on_disk = json.loads((tmp_path / "runs" / "latest" / "results.json").read_text())
    # the SFT-stage methods, outcome-only GRPO, and RFT and ProRAG when stage 2 trained a PRM
    assert on_disk["methods"].keys() >= {"no_retrieval", "standard_rag", "sft", "outcome_grpo"}
    # the SFT agent and every stage 3-4 method also answered the world's extra 3+ hop split, and the paired
    # comparisons count those questions too
    deep = on_disk["deep"]
    assert deep["questions"] == 8 and "sft" in deep["methods"] and "outcome_grpo" in deep["methods"]
    assert all(m["overall"]["n"] == 8 for m in deep["methods"].values())
    # and the held-out split (issue 47), drawn after the deep ones and compared on its own
    held = on_disk["heldout"]
    assert held["questions"] == 6 and set(held["methods"]) == set(deep["methods"])
    assert all(m["overall"]["n"] == 6 for m in held["methods"].values())
    assert held["comparisons"]["outcome_grpo_vs_sft"]["n"] == 6
    # the RL trained on the world's RL split (issue 47): questions SFT never saw, drawn after the held-out split
    world_dir = tmp_path / "data" / "worlds" / "tiny-s7"
    rl_ids = [json.loads(line)["id"] for line in (world_dir / "rl_deep.jsonl").read_text().splitlines()]
    assert len(rl_ids) == 8 and (world_dir / "rl_deep.after").read_text().split() == ["8", "8", "6"]
    job = json.loads((tmp_path / "runs" / "jobs" / on_disk["stage34"]["jobs"]["outcome_grpo"] / "job.json").read_text())
    assert job["config"]["split"] == "rl_deep"
    for name, m in on_disk["methods"].items():
        overall = m["overall"]
        assert overall["n"] == 60
        assert 0.0 <= overall["em"] <= overall["f1"] + 1e-9 <= 1.0 + 1e-9
        lo, hi = overall["f1_ci"]
        assert lo <= overall["f1"] <= hi
        assert set(m["by_hops"]) >= {"1", "2", "3", "4"}
        assert sum(v["n"] for v in m["by_hops"].values()) == 60
    # diagnostics: the format, the agent's first subquery and the copy probe of the base and every trained model
    diag = on_disk["diagnostics"]
    assert set(diag) == {"base"} | set(on_disk["methods"])
    assert 0.0 <= diag["sft"]["first_subquery_entity_rate"] <= 1.0
    assert diag["sft"]["first_subquery_entity_rate"] == on_disk["methods"]["sft"]["first_subquery_entity_rate"]
    assert diag["standard_rag"]["first_subquery_entity_rate"] is None  # not an agent
    # why the 3+ hop answers are wrong, on the split's and the deep split's questions alike
    preds = [json.loads(x) for part in ("", "deep") for x in
             (Path(on_disk["run_dir"]) / part / "sft" / "predictions.jsonl").read_text().splitlines()]
    deep_preds = [p for p in preds if p["hops"] >= 3]
    assert diag["sft"]["answer_errors"]["n"] == len(deep_preds)
    assert diag["sft"]["answer_errors"]["counts"]["right"] == sum(p["f1"] >= 1.0 for p in deep_preds)
    # standard RAG reads with the agent's model: no model (or job, or probe) of its own
    assert on_disk["methods"]["standard_rag"]["reader"] == "sft" and "standard_rag" not in on_disk["jobs"]
    assert diag["standard_rag"]["copy_probe"] is None
    for name in ("base", "no_retrieval", "sft"):  # the probe reads full models, not adapters
        probe = diag[name]["copy_probe"]
        assert probe["names"] > 0 and 0.0 <= probe["name_accuracy"] <= 1.0 and 0.0 <= probe["token_accuracy"] <= 1.0
    # retrieval of gold sub-questions is near perfect on the tiny world
    assert on_disk["retrieval"]["hybrid"]["subquery"]["recall@3"]["overall"]["mean"] > 0.9
    # every prediction and trajectory is saved
    run_dir = (tmp_path / "runs" / "latest").resolve()
    preds = [json.loads(l) for l in (run_dir / "sft" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 60 and all("trajectory" in p and p["trajectory"]["text"] for p in preds)
    assert all(p["finish_reason"] in ("answer", "max_steps", "length", "invalid_format") for p in preds)
    # each method was trained by a finished trainer job and published as a versioned model
    for name, job in on_disk["jobs"].items():
        manifest = json.loads((tmp_path / "runs" / "jobs" / job["job_id"] / "run" / "manifest.json").read_text())
        assert manifest["stage"] == "sft"
        published = tmp_path / "data" / "models" / "tiny-s7" / name / job["job_id"] / "manifest.json"
        recorded = json.loads(published.read_text())
        assert recorded["kind"] == "model" and recorded["config"]["topk"] == 3  # the tiny profile's default depth
        assert recorded["config"]["world"] == "tiny-s7" and job["job_id"].startswith("tiny-s7-")
        assert len(recorded["sha256"]) == 64 and len(recorded["base_model_sha256"]) == 64
    assert results["timings"]["train_sft_s"] > 0
    # stage 2 ran on the trained agent: an MCTS job through the services, then the PRM when pairs were labelled
    prm = on_disk["prm"]
    assert prm["mcts"]["questions"] == 6 and prm["mcts"]["simulations"] > 0
    assert 0.0 <= prm["mcts"]["retrieval_cache_hit_rate"] <= 1.0
    if "skipped" in prm:  # a 24-step tiny agent may write no step the judge can tell apart from its sibling
        assert prm["mcts"]["judge_labelled"] == 0 and "no judge-labelled" in prm["skipped"]
    else:
        auc = prm["auc_gold_vs_corrupted"]
        from prorag.prm.evaluation import FAMILIES, HELD_OUT

        assert 0.0 <= auc["overall"] <= 1.0 and auc["n"] > 0 and set(auc["by_kind"]) <= set(FAMILIES)
        assert set(auc["held_out"]["kinds"]) <= set(HELD_OUT) and auc["held_out"]["n"] > 0
        # the gate's verdict sits beside the AUCs, with its reasons when it is not passed
        assert isinstance(prm["gate"]["passed"], bool) and (prm["gate"]["passed"] or prm["gate"]["reasons"])
        assert (run_dir / "prm" / "scores.png").read_bytes()[:4] == b"\x89PNG"
        assert prm["model"].startswith("prm@tiny-s7-stage2-prm-")
        # the SFT agent's own likelihood on the same cases, the reference the PRM is read against
        reference = prm["reference_policy_likelihood"]
        assert reference["n"] == auc["n"] and set(reference["by_kind"]) == set(auc["by_kind"])
        assert "sft" in reference["policy"] and 0.0 <= reference["overall"] <= 1.0

    # stages 3-4: outcome-only GRPO from the SFT agent (2 iterations x 4 questions x 2 samples), its final adapter
    # evaluated through a policy process; RFT and ProRAG's RL only with a PRM from stage 2
    s34 = on_disk["stage34"]
    rl = s34["rl"]["outcome_grpo"]
    assert rl["iterations"] == 2 and rl["questions"] == 8 and rl["total_sampled"] == 16
    adapter = s34["models"]["outcome_grpo"]["adapter"]
    assert adapter.startswith("outcome_grpo@tiny-s7-stage34-outcome_grpo-") and adapter.endswith("-2")
    preds = [json.loads(l) for l in (run_dir / "outcome_grpo" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 60 and {p["adapter_version"] for p in preds} == {adapter}
    skipped = dict(s34["skipped"])
    # ReasonRAG: DPO on the value-labelled pairs; a tiny tree may hold none, and then the DPO job says so
    if "reasonrag" in skipped:
        assert "no value-labelled pairs" in skipped.pop("reasonrag")
    else:
        assert s34["models"]["reasonrag"]["adapter"].startswith("reasonrag@tiny-s7-stage34-reasonrag-")
    if "skipped" in prm:
        assert set(skipped) == {"rft", "prorag"} and "no PRM" in skipped["prorag"]
    else:
        assert {"rft", "prorag"} <= set(on_disk["methods"]) or set(skipped) == {"rft", "prorag"}
    # paired comparisons over the same 3+ hop test questions
    n3 = sum(q.hops >= 3 for q in load_split(tmp_path / "data" / "worlds" / "tiny-s7", "test"))
    c = on_disk["comparisons"]["outcome_grpo_vs_sft"]
    assert c["group"] == "3+ hops" and c["n"] == n3 + 8 and n3 > 0 and c["seeds"] == 1  # + the deep split's
    assert c["ci"][0] <= c["f1_diff"] <= c["ci"][1] and c["wins"] + c["losses"] + c["ties"] == n3 + 8

    # the run's HTML report beside its results (runs/latest/report/index.html), with the data it shows inlined
    html = (run_dir / "report" / "index.html").read_text()
    assert "outcome_grpo" in html and "<svg" in html

    # a second run reuses the finished jobs instead of training again
    again = run_main_job(profile="tiny", world="tiny-s7", port_offset=free_offset())
    assert {m: j["job_id"] for m, j in again["jobs"].items()} == {m: j["job_id"] for m, j in on_disk["jobs"].items()}
    assert again["timings"]["train_sft_s"] < results["timings"]["train_sft_s"]
    # ... and reads back the evaluations of the same weights on the same questions: same scores, same predictions
    assert json.loads(json.dumps(again["methods"])) == on_disk["methods"]
    for method in ("sft", "outcome_grpo"):
        assert ((Path(again["run_dir"]) / method / "predictions.jsonl").read_text()
                == (Path(results["run_dir"]) / method / "predictions.jsonl").read_text())
    assert again["timings"]["eval_sft_s"] < results["timings"]["eval_sft_s"]
    if "auc_gold_vs_corrupted" in on_disk["prm"]:  # when stage 2 had pairs to train a PRM on
        assert on_disk["prm"]["validation_split"] == "dev"  # the gate decides stages: it never reads test
        assert again["prm"]["auc_gold_vs_corrupted"] == on_disk["prm"]["auc_gold_vs_corrupted"]
        assert again["timings"]["stage2_validate_s"] < results["timings"]["stage2_validate_s"]

    # `prorag up` now serves the agent this run trained, named by its registry reference
    assert on_disk["jobs"]["sft"]["model"] == f"sft@{on_disk['jobs']['sft']['job_id']}"
    assert artifact_name(served_policy("tiny-s7", None)) == on_disk["jobs"]["sft"]["model"]

    # `prorag diagnose rl` on this run: the SFT agent and the RL adapters (after 1 of 2 iterations, and the last)
    # on the RL's questions and on unseen dev deep questions, greedy and sampled
    diag = run_diagnosis(results["run_dir"], questions=3, samples=2, iterations=(1,), port_offset=free_offset())
    assert {"sft", "outcome_grpo", "outcome_grpo@it1"} <= set(diag["models"]) and "prorag" not in diag["models"]
    for name, row in diag["models"].items():
        for s in ("pool", "unseen"):
            assert row[s]["n"] == 3 and row[s]["entropy"] > 0 and 0.0 <= row[s]["sampled_f1"] <= 1.0
            if name != "sft":  # read against the SFT agent, every question in one solve-rate bin
                assert sum(v["n"] for v in row[s]["by_solve_rate"].values()) == 3
                assert row[s]["greedy_ci"][0] <= row[s]["greedy_diff"] <= row[s]["greedy_ci"][1]
        assert name == "sft" or row["reading"] in ("learns", "memorises", "sharpens", "drifts", "no change")
        # every answer came from the model named: the SFT agent itself, or the adapter version asked for
        adapter = diag["adapters"][name]
        assert row["pool"]["adapters"] == row["unseen"]["adapters"] == ([adapter] if adapter else [""])
        for s in ("pool", "unseen"):  # each greedy answer read along its question's chain
            assert sum(row[s]["errors"].values()) == row[s]["n"]
            assert name == "sft" or sum(n for r in row[s]["error_transitions"].values() for n in r.values()) == 3
    assert set(diag["models"]["outcome_grpo"]["pool"]["by_solve_rate"]) == set(SOLVE_RATE_BINS)
    assert json.loads((Path(results["run_dir"]) / "diagnosis.json").read_text())["samples"] == 2

    # `prorag diagnose errors` on this run's recorded trajectories: every question of every model gets one kind,
    # and the right ones are exactly the answers the evaluation scored F1 1
    errors = error_diagnosis(results["run_dir"], min_hops=1)
    preds = [json.loads(x) for part in ("", "deep") for x in
             (Path(results["run_dir"]) / part / "sft" / "predictions.jsonl").read_text().splitlines()]
    assert errors["methods"]["sft"]["n"] == len(preds)
    assert errors["methods"]["sft"]["counts"]["right"] == sum(p["f1"] >= 1.0 for p in preds)
    assert all(sum(row["counts"].values()) == row["n"] for row in errors["methods"].values())
    assert sum(errors["transitions"]["outcome_grpo"]["right"].values()) == errors["methods"]["sft"]["counts"]["right"]

    # the ablation report in small: two stage 3-4 seeds (the SFT agent and stage 2 reused), the RL adapter after its
    # first iteration evaluated too, and one report pooling the seeds
    report = run_ablation(AblationPlan(profile="tiny", seeds=(1, 2), betas=(), eval_iterations=(1,), methods=()),
                          world="tiny-s7", port_offset=free_offset())
    assert report["seeds"]["sft"] == 2 and report["seeds"]["outcome_grpo"] == 2
    assert report["seeds"]["outcome_grpo@it1"] == 1  # the first seed's adapter after 1 of its 2 iterations
    # ... evaluated on the deep split too, so the data-efficiency curve counts its questions
    assert report["data_efficiency"]["questions"] == n3 + 8
    assert report["comparisons"]["outcome_grpo_vs_sft"]["seeds"] == 2
    assert len(report["rl_curves"]["outcome_grpo"]) == 2
    seed_runs = [json.loads((Path(d) / "results.json").read_text()) for d in report["runs"]]
    assert [r["profile"] for r in seed_runs] == ["ablation/seed1", "ablation/seed2"]
    jobs = [r["stage34"]["jobs"]["outcome_grpo"] for r in seed_runs]
    assert len(set(jobs)) == 2 and all(r["jobs"]["sft"]["job_id"] == on_disk["jobs"]["sft"]["job_id"]
                                       for r in seed_runs)
    assert (tmp_path / "runs" / "latest" / "report.md").is_file()
