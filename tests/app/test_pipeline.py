"""`prorag run`'s job identity: reuse a finished job only for the same config and the same base weights."""

from pathlib import Path

import pytest

from prorag_app.pipeline import available_memory_bytes, evaluation_parallelism, job_id_for, training_parallelism


def fake_model(path: Path, weights: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_job_id_follows_config_and_base_weights_not_retriever_address(tmp_path):
    base = fake_model(tmp_path / "policy-base", b"weights v1")
    config = {"mode": "agent", "world": "default", "base_model": base, "retriever": "127.0.0.1:50051", "lr": 3e-3}
    first = job_id_for("default", "sft", config)
    assert first.startswith("default-sft-")
    assert job_id_for("default", "sft", {**config, "retriever": "127.0.0.1:50151"}) == first
    assert job_id_for("default", "sft", {**config, "threads": 1}) == first  # speed, not the model
    assert job_id_for("default", "sft", {**config, "lr": 1e-3}) != first
    fake_model(tmp_path / "policy-base", b"weights v2")  # base rebuilt in place: same path, new weights
    assert job_id_for("default", "sft", config) != first


def test_training_parallelism_keeps_two_threads_per_job_and_shares_the_rest():
    assert training_parallelism(3, cores=2) == (1, 2)  # 2 cores: one job at a time on both
    assert training_parallelism(3, cores=4) == (2, 2)
    assert training_parallelism(3, cores=16) == (3, 5)
    assert training_parallelism(1, cores=16) == (1, 16)
    assert training_parallelism(3, cores=1) == (1, 1)


def test_evaluations_run_side_by_side_as_far_as_memory_holds_their_policy_processes():
    gib = 2**30
    assert evaluation_parallelism(3, 20 * gib) == 3  # make run's three: all at once
    assert evaluation_parallelism(11, 20 * gib, per_process_bytes=2 * gib) == 10
    assert evaluation_parallelism(11, 7 * gib, per_process_bytes=2 * gib) == 3  # a smaller machine, or a busy one
    assert evaluation_parallelism(11, gib // 2, per_process_bytes=2 * gib) == 1  # one at a time, never none
    assert evaluation_parallelism(11, 22 * gib) == 11  # the default budget per process: 2 GiB


def test_available_memory_is_read_from_the_kernel():
    total = Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]
    assert 0 < available_memory_bytes() <= int(total) * 1024


def test_a_method_trains_with_its_own_settings_and_is_evaluated_as_its_published_model_says(tmp_path, monkeypatch):
    from prorag.registry import ArtifactRef, Registry
    from prorag_app.pipeline import eval_options
    from prorag_app.profiles import Profile

    prof = Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={"max_steps": 24, "topk": 3},
                   method_sft={"sft": {"topk": 1}})
    assert prof.sft_for("sft") == {"mode": "agent", "max_steps": 24, "topk": 1}
    assert prof.sft_for("standard_rag_ft") == {"mode": "standard_rag", "max_steps": 24, "topk": 3}
    models = Registry(tmp_path / "models", "model")
    for name, topk in (("sft", 1), ("standard_rag_ft", 3)):
        src = tmp_path / "src" / name
        src.mkdir(parents=True)
        (src / "model.safetensors").write_bytes(name.encode())
        (src / "config.json").write_text("{}")
        models.publish(src, ArtifactRef(name, "job"), config={"topk": topk})
    assert eval_options("sft", str(models.resolve("sft@job"))) == {"topk": 1, "max_steps": 13}
    assert eval_options("standard_rag_ft", str(models.resolve("standard_rag_ft@job"))) == {"topk": 3}
    # standard RAG reads with the agent's model: evaluated with as many documents as the agent searches with
    assert prof.model_of("standard_rag") == "sft" and prof.model_of("sft") == "sft"
    sft_dir = str(models.resolve("sft@job"))
    assert eval_options("standard_rag", sft_dir) == {"topk": 1, "plan_thoughts": False, "restate_question": False,
                                                     "tokenizer_dir": sft_dir}
    with pytest.raises(SystemExit, match="documents per search"):
        eval_options("sft", str(tmp_path / "src" / "sft"))  # never published: nothing says how it was trained


def test_the_research_plan_runs_its_profile_over_three_seeds_on_the_split_asked(monkeypatch):
    import argparse

    from prorag.methods import get_method
    from prorag_app import cli, pipeline, profiles

    prof = profiles.PROFILES["research"]
    s34 = prof.stage34
    # every arm runs, whatever the PRM gate says (issue 47: its verdict is reported beside them); the headline's
    # two methods start from the same model and draw from one pool
    assert set(s34["methods"]) == {"rft", "prorag", "outcome_grpo", "prorag_no_rft", "prorag_oracle", "reasonrag"}
    assert s34["pool"]["samples"] == s34["rl"]["group_size"] and s34["prm_gate"] == "report"
    # the arms differ in the process term only: one outcome reward without a format term, a step score without one
    assert s34["rl"]["reward"] == "f1" and s34["rl"]["step_score"] == "verdict"
    assert prof.stage2["siblings"]["max_questions"] > prof.stage2["mcts"]["max_questions"]
    assert get_method("prorag_no_rft").stage == get_method("outcome_grpo").stage == "rl"
    assert profiles.PLANS["research"].seeds == (1, 2, 3)

    calls = []
    monkeypatch.setattr(pipeline, "run_ablation", lambda plan, **kw: calls.append((plan, kw)))
    args = argparse.Namespace(profile="research", stage34_seed=None, beta=None, split="dev",
                              set=["stage34.rl.iterations=50"], world=None, port_offset=0, policy_replicas=3)
    assert cli.cmd_run(args) == 0
    plan, kw = calls[0]
    assert plan.name == "research" and kw["split"] == "dev" and kw["overrides"] == ("stage34.rl.iterations=50",)
    assert kw["policy_replicas"] == 3
    with pytest.raises(SystemExit, match="--policy-replicas is -1"):
        cli.cmd_run(argparse.Namespace(**{**vars(args), "policy_replicas": -1}))
    # one seed of it is a single run
    single = []
    monkeypatch.setattr(pipeline, "run_main_job", lambda **kw: single.append(kw))
    assert cli.cmd_run(argparse.Namespace(**{**vars(args), "stage34_seed": 2})) == 0
    assert single[0]["stage34_seed"] == 2 and single[0]["prof"].stage34["rl"]["iterations"] == 50
    assert single[0]["policy_replicas"] == 3
    assert single[0]["prof"].eval_split == "dev"


def test_the_ablation_runs_its_own_stage34_methods_where_the_profile_leaves_some_out(tmp_path, monkeypatch):
    from prorag_app import pipeline, profiles

    runs = []

    def fake_run(name, world, port_offset, prof, policy_replicas):  # each run's profile, as run_main_job gets it
        assert policy_replicas == 0  # the default: run_main_job picks the processes
        runs.append((name, prof.stage34))
        return {"run_dir": str(tmp_path / str(len(runs)))}

    def fake_report(dirs, out):
        (out / "report.md").write_text("report")
        return {"runs": dirs}

    monkeypatch.setattr(pipeline, "run_main_job", fake_run)
    monkeypatch.setattr(pipeline, "build_report", fake_report)
    monkeypatch.setattr(pipeline, "new_run_dir", lambda name: tmp_path)
    monkeypatch.setattr(pipeline, "point_latest", lambda out: None)
    plan = profiles.AblationPlan(seeds=(1, 2), betas=(0.5,))
    pipeline.run_ablation(plan)
    names = [n for n, _ in runs]
    assert names == ["ablation/seed1", "ablation/seed2", "ablation/beta0.5"]
    for name, s34 in runs[:2]:  # every seed runs the full ProRAG and RFT the default leaves out
        assert {"rft", "prorag", "outcome_grpo", "prorag_no_rft"} <= set(s34["methods"]), name
    assert runs[2][1]["methods"] == ("prorag",)
    # a plan with no methods of its own keeps the profile's
    runs.clear()
    pipeline.run_ablation(profiles.AblationPlan(seeds=(1,), betas=(), eval_iterations=(), methods=()))
    assert set(runs[0][1]["methods"]) == {*profiles.PROFILES["default"].stage34["methods"], "prorag_no_rft"}
