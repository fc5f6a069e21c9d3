"""prorag_app.stage34: which finished stage 3-4 job a run may reuse."""

from __future__ import annotations

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
