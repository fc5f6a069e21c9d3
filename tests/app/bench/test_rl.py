"""`prorag bench rl`: one RL update in one padded pass against length-sorted chunks, and the split of a run's RL
iterations into their parts."""


def test_bench_rl_times_one_padded_pass_against_length_chunks(tiny_policy, monkeypatch, tmp_path):
    import argparse

    from prorag_app.bench.rl import bench_rl

    monkeypatch.setenv("PRORAG_RUNS", str(tmp_path / "runs"))  # no saved trajectories: uniform lengths
    model_dir, _ = tiny_policy
    out = bench_rl(argparse.Namespace(world="tiny", model=str(model_dir), questions=2, samples=4, repeats=1))
    assert out["trajectories"] == 8 and out["lengths_from"] == "uniform 200-1000"
    assert out["one_pass"]["chunks"] == 1 and out["chunked"]["chunks"] >= 1
    assert out["chunked"]["padded_tokens"] <= out["one_pass"]["padded_tokens"]
    assert out["one_pass"]["padded_tokens"] >= out["tokens"] and out["ratio"] > 0
    assert out["step_split"] == {} and out["step_split_from"] is None  # no `prorag run` yet


def test_rl_step_split_gives_each_part_of_an_iteration_and_its_share():
    from prorag_app.bench.rl import rl_step_split

    results = {"stage34": {"rl": {"prorag": {"median_rollout_s": 6.0, "median_prm_scoring_s": 3.0,
                                             "median_reward_s": 0.0, "median_update_s": 10.0,
                                             "median_adapter_sync_s": 1.0, "iterations": 10},
                                  "outcome_grpo": {"median_rollout_s": 5.0, "median_update_s": 5.0}}}}
    split = rl_step_split(results)
    assert split["prorag"]["iteration_s"] == 20.0
    assert split["prorag"]["update_share"] == 0.5 and split["prorag"]["prm_scoring_share"] == 0.15
    assert split["outcome_grpo"]["prm_scoring_s"] == 0.0 and split["outcome_grpo"]["rollout_share"] == 0.5
    assert rl_step_split({"methods": {}}) == {} and rl_step_split({"stage34": None}) == {}
