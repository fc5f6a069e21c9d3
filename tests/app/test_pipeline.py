"""`prorag run`'s job identity: reuse a finished job only for the same config and the same base weights."""

from pathlib import Path

import pytest

from prorag_app.pipeline import job_id_for, training_parallelism


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


def test_every_profile_is_a_valid_sft_and_warmup_config_and_variants_keep_their_own_base():
    from prorag.config import from_dict
    from prorag.methods import METHODS
    from prorag_app.embedded import policy_base_dir
    from prorag_app.pipeline import PROFILES
    from prorag.modeling import PRESETS, WarmupConfig
    from services.trainer.stage_sft import SFTConfig

    for name, prof in PROFILES.items():
        assert prof.model_preset in PRESETS, name
        for method in (*prof.trained_methods, *prof.method_sft):
            settings = prof.sft_for(method)
            assert settings["mode"] == METHODS[method].kind  # each method trains on its own kind of data
            cfg = from_dict(SFTConfig, {"world": prof.world, "base_model": str(Path.cwd()), **settings})
            assert cfg.max_steps > 0, (name, method)
        if prof.base_warmup is not None:
            from_dict(WarmupConfig, prof.base_warmup)
    # profiles whose bases differ never share a base directory (one would rebuild the other's in place)
    from prorag_app.embedded import DEFAULT_POLICY, DEFAULT_WARMUP

    bases = {}
    for name, prof in PROFILES.items():
        size = prof.world if prof.world in DEFAULT_POLICY else "default"
        warmup = DEFAULT_WARMUP.get(size, {}) if prof.base_warmup is None else prof.base_warmup
        settings = (prof.model_preset, prof.vocab_size, tuple(sorted(warmup.items())))
        where = policy_base_dir(prof.world, prof.base_variant)
        assert bases.setdefault(where, settings) == settings, (name, where)
    # the default profile is the recipe that reaches the figure, and its base is what `prorag base` / `up` build
    assert PROFILES["default"] is PROFILES["full"]
    assert (PROFILES["default"].model_preset, PROFILES["default"].vocab_size) == DEFAULT_POLICY["default"]
    assert PROFILES["default"].base_warmup is None and not PROFILES["default"].base_variant


def test_profiles_are_checked_when_they_are_defined():
    import pytest

    from prorag.config import ConfigError
    from prorag.errors import InvalidArgument
    from prorag_app.pipeline import Profile

    with pytest.raises(ConfigError, match="sft.lerning_rate"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={"lerning_rate": 1e-3})
    with pytest.raises(ConfigError, match="method_sft.sft.topk"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, method_sft={"sft": {"topk": 0}})
    with pytest.raises(InvalidArgument, match="unknown method"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, methods=("sft", "rlhf"))
    with pytest.raises(ConfigError, match="base_warmup.copy_stepz"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, base_warmup={"copy_stepz": 1})


def test_a_method_trains_with_its_own_settings_and_is_evaluated_as_its_published_model_says(tmp_path, monkeypatch):
    from prorag.registry import ArtifactRef, Registry
    from prorag_app.pipeline import Profile, eval_options

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
    import pytest

    with pytest.raises(SystemExit, match="documents per search"):
        eval_options("sft", str(tmp_path / "src" / "sft"))  # never published: nothing says how it was trained


def test_a_method_that_reads_with_another_models_trains_nothing_and_needs_that_model():
    from prorag.errors import InvalidArgument
    from prorag_app.pipeline import PROFILES, Profile

    prof = Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={},
                   methods=("no_retrieval", "standard_rag", "sft"))
    assert prof.trained_methods == ("no_retrieval", "sft")
    with pytest.raises(InvalidArgument, match="reads with 'sft'"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, methods=("no_retrieval", "standard_rag"))
    with pytest.raises(InvalidArgument, match="not SFT"):  # a reader has no SFT settings of its own
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, method_sft={"standard_rag": {"topk": 1}})
    # the default trains the agent and the no-retrieval baseline; the fine-tuned standard RAG only when listed
    assert PROFILES["default"].trained_methods == ("no_retrieval", "sft")
    assert "standard_rag_ft" in PROFILES["default"].method_sft


def test_set_overrides_reach_nested_settings_and_are_checked_like_the_profile():
    from prorag.config import ConfigError
    from prorag.errors import InvalidArgument
    from prorag_app.pipeline import PROFILES, with_overrides

    base = PROFILES["default"]
    recipe_lr = base.stage34["rft"]["lr"]
    assert with_overrides(base, []) is base
    tuned = with_overrides(base, ["stage34.rft.lr=3e-5", 'stage34.methods=["rft"]', "eval_split=dev",
                                  'methods=["sft"]'])
    assert tuned.stage34["rft"]["lr"] == 3e-5 != recipe_lr and tuned.stage34["methods"] == ("rft",)
    assert tuned.eval_split == "dev" and tuned.methods == ("sft",)
    # the rest as the profile says, and the profile itself untouched
    assert tuned.stage34["rft"]["samples_per_question"] == base.stage34["rft"]["samples_per_question"]
    assert base.stage34["rft"]["lr"] == recipe_lr and base.eval_split == "test"
    with pytest.raises(ConfigError, match="stage34.rft.lerning_rate"):
        with_overrides(base, ["stage34.rft.lerning_rate=1e-4"])
    with pytest.raises(ConfigError, match="stage34.rl.lr"):
        with_overrides(base, ["stage34.rl.lr=-1"])
    with pytest.raises(InvalidArgument, match="no field 'stagge34'"):
        with_overrides(base, ["stagge34.rft.lr=1e-4"])
    with pytest.raises(InvalidArgument, match="KEY=VALUE"):
        with_overrides(base, ["stage34.rft.lr"])
    with pytest.raises(InvalidArgument, match="not test or dev"):
        with_overrides(base, ["eval_split=train"])


def test_the_research_plan_runs_its_profile_over_three_seeds_on_the_split_asked(monkeypatch):
    import argparse

    from prorag.methods import get_method
    from prorag_app import cli, pipeline

    prof = pipeline.PROFILES["research"]
    s34 = prof.stage34
    # the headline's two methods start from the same model, draw from one pool, and the PRM must pass its gate
    assert {"outcome_grpo", "prorag_no_rft", "prorag_oracle"} <= set(s34["methods"])
    assert s34["pool"]["samples"] == s34["rl"]["group_size"] and s34["prm_gate"] == "enforce"
    assert prof.stage2["siblings"]["max_questions"] > prof.stage2["mcts"]["max_questions"]
    assert get_method("prorag_no_rft").stage == get_method("outcome_grpo").stage == "rl"
    assert pipeline.PLANS["research"].seeds == (1, 2, 3)

    calls = []
    monkeypatch.setattr(pipeline, "run_ablation", lambda plan, **kw: calls.append((plan, kw)))
    args = argparse.Namespace(profile="research", stage34_seed=None, beta=None, split="dev",
                              set=["stage34.rl.iterations=50"], world=None, port_offset=0)
    assert cli.cmd_run(args) == 0
    plan, kw = calls[0]
    assert plan.name == "research" and kw["split"] == "dev" and kw["overrides"] == ("stage34.rl.iterations=50",)
    # one seed of it is a single run
    single = []
    monkeypatch.setattr(pipeline, "run_main_job", lambda **kw: single.append(kw))
    assert cli.cmd_run(argparse.Namespace(**{**vars(args), "stage34_seed": 2})) == 0
    assert single[0]["stage34_seed"] == 2 and single[0]["prof"].stage34["rl"]["iterations"] == 50
    assert single[0]["prof"].eval_split == "dev"
