"""prorag_app.stage34: which finished stage 3-4 job a run may reuse, the RL methods' job configs (the oracle, the
shared question pool) and what the stage reports."""

from __future__ import annotations

import pytest

from prorag_app.stage34 import _job_id


def test_a_retrained_prm_gets_new_prm_guided_jobs_and_keeps_the_others():
    rft = {"world": "w", "base_model": "sft@a", "policy": "127.0.0.1:1", "prm": "127.0.0.1:2", "lr": 1e-4}
    rl = {"world": "w", "base_model": "rft@b", "policy": "127.0.0.1:1", "prm": "127.0.0.1:2", "beta": 0.3}
    outcome = {**rl, "base_model": "sft@a", "prm": "", "beta": 0.0}
    for stage, cfg in (("rft", rft), ("prorag", rl)):
        assert _job_id("w-stage34", stage, cfg, "prm-one") == _job_id("w-stage34", stage, dict(cfg), "prm-one")
        assert _job_id("w-stage34", stage, cfg, "prm-one") != _job_id("w-stage34", stage, cfg, "prm-two")
        # the PRM service's address is where it runs, not what it is
        assert (_job_id("w-stage34", stage, cfg, "prm-one")
                == _job_id("w-stage34", stage, {**cfg, "prm": "127.0.0.1:9"}, "prm-one"))
    # outcome-only GRPO asks no PRM: one job whatever stage 2 trained
    assert _job_id("w-stage34", "outcome_grpo", outcome, "prm-one") == _job_id("w-stage34", "outcome_grpo", outcome,
                                                                              "prm-two")


def test_a_job_sampling_the_rl_split_is_named_by_its_content(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path))
    world = tmp_path / "worlds" / "w"
    world.mkdir(parents=True)
    (world / "rl_deep.jsonl").write_text('{"id": "rl_deep_0", "question": "Who?"}\n')
    pool = {"world": "w", "split": "rl_deep", "policy_model": "sft@a", "samples": 8}
    first = _job_id("w-stage34", "rlpool", pool)
    assert _job_id("w-stage34", "rlpool", dict(pool)) == first
    # redrawn after a dev deep split of another size: the same ids name other questions, so another job
    (world / "rl_deep.jsonl").write_text('{"id": "rl_deep_0", "question": "Where?"}\n')
    assert _job_id("w-stage34", "rlpool", pool) != first
    # the world's own splits never change, and jobs on them keep their ids without reading them
    train = {**pool, "split": "train"}
    assert _job_id("w-stage34", "rlpool", train) == _job_id("w-stage34", "rlpool", {**train, "world": "w"})


def test_the_oracle_is_its_own_job_with_no_prm_and_every_rl_method_shares_the_pool():
    import pytest

    from prorag_app.stage34 import RL_METHODS, rl_job_config

    common = {"world": "w", "topk": 1, "iterations": 5}
    cfgs = {m: rl_job_config(m, common, "sft@a", "127.0.0.1:1", "127.0.0.1:2", 0.3, "/runs/pool.json")
            for m in RL_METHODS}
    assert cfgs["prorag_oracle"]["step_scorer"] == "oracle" and cfgs["prorag_oracle"]["prm"] == ""
    assert cfgs["prorag_oracle"]["beta"] == 0.3 == cfgs["prorag_no_rft"]["beta"]
    assert cfgs["outcome_grpo"]["beta"] == 0.0 and cfgs["outcome_grpo"]["prm"] == ""
    assert all("step_scorer" not in c for m, c in cfgs.items() if m != "prorag_oracle")
    assert {c["question_pool"] for c in cfgs.values()} == {"/runs/pool.json"}
    assert {c["adapter_name"] for c in cfgs.values()} == set(RL_METHODS)
    # the oracle's job is neither outcome GRPO's nor ProRAG's, and no PRM retraining touches it
    oracle = _job_id("w-stage34", "prorag_oracle", cfgs["prorag_oracle"], "", "pool-one")
    assert oracle != _job_id("w-stage34", "prorag_oracle", {**cfgs["prorag_oracle"], "step_scorer": "prm"}, "",
                             "pool-one")
    assert oracle != _job_id("w-stage34", "outcome_grpo", cfgs["outcome_grpo"], "", "pool-one")
    # the pool counts by content: another pool, another job; the same pool elsewhere on disk, the same job
    assert oracle != _job_id("w-stage34", "prorag_oracle", cfgs["prorag_oracle"], "", "pool-two")
    assert oracle == _job_id("w-stage34", "prorag_oracle", {**cfgs["prorag_oracle"], "question_pool": "/x/pool.json"},
                             "", "pool-one")
    # jobs without a pool keep the ids they had before pools existed
    plain = rl_job_config("outcome_grpo", common, "sft@a", "127.0.0.1:1", "", 0.3)
    assert "question_pool" not in plain and _job_id("w-stage34", "outcome_grpo", plain) == _job_id(
        "w-stage34", "outcome_grpo", {**common, "base_model": "sft@a", "policy": "127.0.0.1:9", "prm": "",
                                      "beta": 0.0, "adapter_name": "outcome_grpo"})
    with pytest.raises(ValueError, match="step_scorer"):
        rl_job_config("prorag", {**common, "step_scorer": "oracle"}, "rft@b", "p", "q", 0.3)


def test_the_oracle_never_inherits_per_kind_centring_and_the_prm_arms_keep_the_shared_settings():
    from prorag_app.stage34 import PROCESS_ONLY, RL_METHODS, rl_job_config

    common = {"world": "w", "topk": 1, "prm_centering": "per_kind", "step_score": "verdict",
              "process_answer_step": False, "reward": "f1"}
    cfgs = {m: rl_job_config(m, common, "sft@a", "p", "q", 0.3) for m in RL_METHODS}
    assert cfgs["prorag_oracle"]["prm_centering"] == "none"
    assert {cfgs[m]["prm_centering"] for m in ("prorag", "prorag_no_rft")} == {"per_kind"}
    # one outcome reward for every arm and one step score for every process arm: they differ in the process term only
    assert {c["reward"] for c in cfgs.values()} == {"f1"}
    assert {c["step_score"] for m, c in cfgs.items() if m != "outcome_grpo"} == {"verdict"}
    # outcome GRPO reads none of the process term's settings, so its job is the same whatever they are
    assert not set(PROCESS_ONLY) & set(cfgs["outcome_grpo"])
    assert rl_job_config("outcome_grpo", {**common, "prm_centering": "none", "process_std_floor": 0.5}, "sft@a", "p",
                         "q", 0.3) == cfgs["outcome_grpo"]
    # without shared centring the oracle's config (and so its job id) is what it was
    plain = rl_job_config("prorag_oracle", {"world": "w", "topk": 1}, "sft@a", "p", "q", 0.3)
    assert "prm_centering" not in plain


def test_the_pool_job_samples_the_rl_candidates_as_the_rl_samples_them():
    from prorag.config import from_dict
    from prorag_app.stage34 import pool_job_config
    from services.trainer.stage_rlpool import RLPoolConfig

    rl = {"min_hops": 3, "max_questions": 400, "temperature": 0.9, "max_steps": 9, "lr": 1e-5, "seed": 2,
          "group_size": 8}
    cfg = pool_job_config("w", "sft@a", "127.0.0.1:1", 3, rl, {"samples": 8, "max_questions": 200})
    assert cfg == {"world": "w", "policy_model": "sft@a", "policy": "127.0.0.1:1", "topk": 3, "min_hops": 3,
                   "max_questions": 200, "temperature": 0.9, "max_steps": 9, "samples": 8}
    from_dict(RLPoolConfig, cfg)  # a valid job config: nothing RL-only (lr, seed, group size) leaks in


def test_rl_summary_reports_zero_variance_groups_and_reward_per_iteration(tmp_path):
    import json

    from prorag_app.stage34 import rl_summary

    rows = [{"iteration": 0, "groups": 4, "groups_flat": 3, "reward_mean": 0.5, "f1_mean": 0.1},
            {"iteration": 1, "groups": 4, "groups_flat": 1, "reward_mean": 1.5, "f1_mean": 0.4}]
    path = tmp_path / "iterations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = rl_summary(path)
    assert s["groups_flat_fraction"] == 0.5
    assert s["per_iteration"] == [{"iteration": 0, "groups_flat_fraction": 0.75, "reward_mean": 0.5, "f1_mean": 0.1},
                                  {"iteration": 1, "groups_flat_fraction": 0.25, "reward_mean": 1.5, "f1_mean": 0.4}]
    assert s["f1_halves"] == [0.1, 0.4] and s["reward_halves"] == [0.5, 1.5]
    # an odd count leaves the middle iteration out of both halves
    path.write_text("".join(json.dumps({"iteration": i, "f1_mean": f}) + "\n" for i, f in enumerate((0.1, 0.2, 0.9))))
    assert rl_summary(path)["f1_halves"] == [0.1, 0.9] and "f1_gain_halves" not in rl_summary(path)
    # with a pool, each iteration's F1 is also read against the start model's on the same questions
    path.write_text("".join(json.dumps({"iteration": i, "f1_mean": f, "start_f1_mean": s}) + "\n"
                            for i, (f, s) in enumerate(((0.3, 0.4), (0.5, 0.3)))))
    summary = rl_summary(path)
    assert summary["f1_gain_halves"] == pytest.approx([-0.1, 0.2])
    assert summary["per_iteration"][1]["start_f1_mean"] == 0.3


class _Stack:
    """What run_stage34 asks of a running stack and of the serving stacks it starts: targets, a with-block."""

    def __init__(self, *a, **kw):
        self.started = kw

    def grpc_target(self, service):
        return f"127.0.0.1:{ {'retriever': 1, 'policy': 2, 'prm': 3}[service] }"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _recording_trainer(tmp_path, learnable_ids):
    """A run_job that records each submitted job and answers as the trainer's stages do (outputs, run_dir): the
    rlpool job's pool.json, an RL job's adapter and iterations.jsonl."""
    import json

    submitted = []

    def run_job(stack, stage, config, job_id, before_start=None):
        if before_start is not None:  # as the real one does when it submits a job (every one here)
            before_start()
        submitted.append((stage, config, job_id))
        run = tmp_path / job_id
        run.mkdir(parents=True, exist_ok=True)
        if stage == "rlpool":
            pool = {"world": config["world"], "split": "train", "samples": config["samples"], "pool": learnable_ids,
                    "counts": {"candidates": 5, "all_right": 1, "all_wrong": 5 - 1 - len(learnable_ids),
                               "learnable": len(learnable_ids), "by_hops": {}}}
            (run / "pool.json").write_text(json.dumps(pool))
            return {"job_id": job_id, "metrics": {}, "outputs": {"pool_path": str(run / "pool.json")},
                    "run_dir": str(run)}
        (run / "iterations.jsonl").write_text(json.dumps({"iteration": 0, "groups": 2, "groups_flat": 1}) + "\n")
        return {"job_id": job_id, "metrics": {}, "outputs": {"adapter": f"{config['adapter_name']}@{job_id}-1"},
                "run_dir": str(run)}

    return run_job, submitted


def _run(tmp_path, monkeypatch, learnable_ids, **settings):
    from prorag.config import from_dict
    from prorag_app import stage34
    from prorag_app.stage34 import run_stage34
    from prorag_app.stage_settings import Stage34Settings

    run_job, submitted = _recording_trainer(tmp_path / "jobs", learnable_ids)
    monkeypatch.setattr(stage34, "run_job", run_job)
    monkeypatch.setattr(stage34, "ServiceStack", _Stack)
    s = from_dict(Stage34Settings, {"methods": ["outcome_grpo", "prorag_oracle", "prorag"], **settings})
    out = run_stage34(_Stack(), "w", "sft@a", str(tmp_path / "sft"), None, {"topk": 1}, s, tmp_path / "run", 0, {})
    return out, submitted


def test_stage34_runs_the_pool_first_and_every_rl_job_draws_from_it(tmp_path, monkeypatch):
    out, submitted = _run(tmp_path, monkeypatch, ["q1", "q3"], pool={"samples": 8}, rl={"min_hops": 3})
    stages = [(stage, c.get("adapter_name", "")) for stage, c, _ in submitted]
    # no PRM (stage 2 trained none): ProRAG is skipped, the oracle still runs; the pool comes before any RL job
    assert stages == [("rlpool", ""), ("rl", "outcome_grpo"), ("rl", "prorag_oracle")]
    pool_cfg, pool_path = submitted[0][1], out["pool"]["path"]
    assert pool_cfg["policy_model"] == "sft@a" and pool_cfg["min_hops"] == 3 and pool_cfg["samples"] == 8
    assert all(c["question_pool"] == pool_path for stage, c, _ in submitted if stage == "rl")
    assert out["pool"]["size"] == 2 and out["pool"]["counts"]["learnable"] == 2
    assert "prorag" in out["skipped"] and set(out["models"]) == {"outcome_grpo", "prorag_oracle"}
    assert out["rl"]["prorag_oracle"]["per_iteration"][0]["groups_flat_fraction"] == 0.5
    oracle_cfg = submitted[2][1]
    assert oracle_cfg["step_scorer"] == "oracle" and oracle_cfg["prm"] == "" and oracle_cfg["beta"] == 0.3
    assert out["jobs"]["prorag_oracle"] != out["jobs"]["outcome_grpo"]


def test_stage34_without_pool_settings_runs_no_pool_job(tmp_path, monkeypatch):
    out, submitted = _run(tmp_path, monkeypatch, [])
    assert [stage for stage, _, _ in submitted] == ["rl", "rl"] and "pool" not in out
    assert all("question_pool" not in c for _, c, _ in submitted)


def test_an_empty_pool_skips_the_rl_methods_with_the_reason(tmp_path, monkeypatch):
    out, submitted = _run(tmp_path, monkeypatch, [], pool={"samples": 8})
    assert [stage for stage, _, _ in submitted] == ["rlpool"]
    assert "no learnable question" in out["skipped"]["outcome_grpo"] and "prorag_oracle" in out["skipped"]
    assert "no PRM" in out["skipped"]["prorag"]  # the first reason stays
    assert not out["models"]


def _run_with_prm(tmp_path, monkeypatch, gate, **settings):
    from prorag.config import from_dict
    from prorag_app import stage34
    from prorag_app.stage34 import run_stage34
    from prorag_app.stage_settings import Stage34Settings

    run_job, submitted = _recording_trainer(tmp_path / "jobs", [])
    monkeypatch.setattr(stage34, "run_job", run_job)
    monkeypatch.setattr(stage34, "ServiceStack", _Stack)
    monkeypatch.setattr(stage34, "weights_sha256", lambda d: "0" * 64)
    s = from_dict(Stage34Settings, {"methods": ["outcome_grpo", "prorag_oracle", "prorag_no_rft"], **settings})
    out = run_stage34(_Stack(), "w", "sft@a", str(tmp_path / "sft"), str(tmp_path / "prm"), {"topk": 1}, s,
                      tmp_path / "run", 0, {}, prm_gate=gate)
    return out, submitted


FAILED_GATE = {"passed": False, "reasons": ["unsupported_subanswer AUC 0.51 < 0.8"], "min_unsupported": 0.8,
               "min_overall": 0.9}


def test_an_enforced_gate_keeps_a_failing_prm_from_guiding_anything(tmp_path, monkeypatch):
    out, submitted = _run_with_prm(tmp_path, monkeypatch, FAILED_GATE, prm_gate="enforce")
    assert [c["adapter_name"] for stage, c, _ in submitted] == ["outcome_grpo", "prorag_oracle"]
    assert "did not pass the gate" in out["skipped"]["prorag_no_rft"]
    assert "unsupported_subanswer AUC 0.51" in out["skipped"]["prorag_no_rft"]
    assert out["prm_gate"] == FAILED_GATE and all(not c.get("prm") for _, c, _ in submitted)


def test_a_reported_gate_lets_the_prm_guide_and_records_the_verdict(tmp_path, monkeypatch):
    out, submitted = _run_with_prm(tmp_path, monkeypatch, FAILED_GATE)  # the default: report
    by_method = {c["adapter_name"]: c for stage, c, _ in submitted}
    assert set(by_method) == {"outcome_grpo", "prorag_oracle", "prorag_no_rft"} and not out["skipped"]
    assert by_method["prorag_no_rft"]["prm"] == "127.0.0.1:3" and not by_method["outcome_grpo"]["prm"]
    assert out["prm_gate"] == FAILED_GATE
    passed = {**FAILED_GATE, "passed": True, "reasons": []}
    out, submitted = _run_with_prm(tmp_path / "again", monkeypatch, passed, prm_gate="enforce")
    assert "prorag_no_rft" in [c["adapter_name"] for stage, c, _ in submitted] and not out["skipped"]


def test_methods_a_profile_leaves_out_are_reported_as_skipped_with_the_reason(tmp_path, monkeypatch):
    why = "left out of this profile for time"
    out, submitted = _run_with_prm(tmp_path, monkeypatch, None, methods=["outcome_grpo"],
                                   left_out={"rft": why, "prorag": why})
    assert [c["adapter_name"] for _, c, _ in submitted] == ["outcome_grpo"]  # no RFT job for a left-out method
    assert out["skipped"] == {"rft": why, "prorag": why} and set(out["models"]) == {"outcome_grpo"}
    # asked for all the same (`--set stage34.methods=...`), it runs and is not reported as left out
    out, submitted = _run_with_prm(tmp_path / "asked", monkeypatch, None, methods=["outcome_grpo", "prorag_no_rft"],
                                   left_out={"prorag_no_rft": why})
    assert [c["adapter_name"] for _, c, _ in submitted] == ["outcome_grpo", "prorag_no_rft"] and not out["skipped"]


def test_the_default_profile_runs_the_headline_and_says_where_rft_and_full_prorag_are():
    from prorag_app.profiles import PLANS, PROFILES

    s34 = PROFILES["default"].stage34
    assert {"outcome_grpo", "prorag_no_rft"} <= set(s34["methods"])  # the same-start headline
    assert set(s34["left_out"]) == {"rft", "prorag"} and all("research" in why for why in s34["left_out"].values())
    # the research profile and the ablation plan run them
    assert {"rft", "prorag"} <= set(PROFILES["research"].stage34["methods"])
    assert not PROFILES["research"].stage34["left_out"]
    assert {"rft", "prorag", "prorag_no_rft", "outcome_grpo"} <= set(PLANS["ablation"].methods)
    # its RL settings are RLConfig's and valid: the pool's questions the agent mostly fails, chosen on dev
    from dataclasses import fields

    from services.trainer.stage_rl import RLConfig
    research_rl = PROFILES["research"].stage34["rl"]
    assert set(research_rl) <= {f.name for f in fields(RLConfig)}
    RLConfig(**{**research_rl, "base_model": "sft@x"}).validate()
    assert research_rl["pool_max_solve_rate"] < 1 and "pool" in PROFILES["research"].stage34
    # `make run`'s RL draws from a learnable pool too, and its arms differ in the process term only (issue 47)
    default_rl = s34["rl"]
    RLConfig(**{**default_rl, "base_model": "sft@x"}).validate()
    assert default_rl["pool_max_solve_rate"] < 1 and s34["pool"]["samples"] == default_rl["group_size"]
    assert default_rl["reward"] == "f1" and default_rl["step_score"] == "verdict"
    assert default_rl["process_answer_step"] is False
    # the PRM arms' logits centred per step kind (chosen on dev), in both profiles
    assert default_rl["prm_centering"] == research_rl["prm_centering"] == "per_kind"
    # the research profile changes its size, and its rollouts' temperature (with log-probs of that distribution),
    # which its budget chose on dev; nothing else
    sized = ("iterations", "questions_per_iteration", "kl_coef", "temperature", "tempered_logprobs")
    assert {k: v for k, v in research_rl.items() if k not in sized} == \
        {k: v for k, v in default_rl.items() if k not in sized}
    assert (research_rl["temperature"], research_rl["tempered_logprobs"]) == (0.7, True)
    assert default_rl.get("temperature", 1.0) == 1.0
    # the data-efficiency point is a third of the RL questions
    assert PROFILES["research"].stage34["eval_iterations"] == (research_rl["iterations"] // 3,)
    # the research profile keeps its own MCTS size whatever the default's
    assert PROFILES["research"].stage2["mcts"]["max_questions"] == 200
    # and its longer SFT, every other SFT setting shared with the recipe
    research_sft, default_sft = PROFILES["research"].sft, PROFILES["default"].sft
    assert research_sft["max_steps"] > default_sft["max_steps"]
    assert {k: v for k, v in research_sft.items() if k != "max_steps"} == \
        {k: v for k, v in default_sft.items() if k != "max_steps"}
