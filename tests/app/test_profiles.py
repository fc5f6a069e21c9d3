"""`prorag run`'s profiles: checked when defined, each a valid set of job settings, and changed for one run by
``--set`` only through the same checks."""

from pathlib import Path

import pytest


def test_every_profile_is_a_valid_sft_and_warmup_config_and_variants_keep_their_own_base():
    from prorag.config import from_dict
    from prorag.methods import METHODS
    from prorag_app.embedded import policy_base_dir
    from prorag_app.profiles import PROFILES
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
    from prorag.config import ConfigError
    from prorag.errors import InvalidArgument
    from prorag_app.profiles import Profile

    with pytest.raises(ConfigError, match="sft.lerning_rate"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={"lerning_rate": 1e-3})
    with pytest.raises(ConfigError, match="method_sft.sft.topk"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, method_sft={"sft": {"topk": 0}})
    with pytest.raises(InvalidArgument, match="unknown method"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, methods=("sft", "rlhf"))
    with pytest.raises(ConfigError, match="base_warmup.copy_stepz"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, base_warmup={"copy_stepz": 1})
    # only stage 3-4 methods are left out of stages 3-4
    with pytest.raises(InvalidArgument, match="not a stage 3-4 method"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={},
                stage34={"methods": ("outcome_grpo",), "left_out": {"sft": "time"}})
    # the RL split is sized by rl_questions and named by stage34.rl.split: both or neither, after the deep splits
    for kw in ({"rl_questions": 100, "deep_questions": 8, "stage34": {"rl": {}}},
               {"deep_questions": 8, "stage34": {"rl": {"split": "rl_deep"}}}):
        with pytest.raises(InvalidArgument, match="set both, or neither"):
            Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, **kw)
    with pytest.raises(InvalidArgument, match="set deep_questions too"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, rl_questions=100,
                stage34={"rl": {"split": "rl_deep"}})
    # the mixed RL split is sized by rl_questions as well; with min_hops 3 it would be the deep one's hop counts
    Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, rl_questions=100, deep_questions=8,
            stage34={"rl": {"split": "rl_mixed", "min_hops": 0}})
    with pytest.raises(InvalidArgument, match="set both, or neither"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, deep_questions=8,
                stage34={"rl": {"split": "rl_mixed"}})
    with pytest.raises(InvalidArgument, match="keeps only its 3\\+ hop questions: set stage34.rl.min_hops=0"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={}, rl_questions=100, deep_questions=8,
                stage34={"rl": {"split": "rl_mixed", "min_hops": 3}})
    # the RL's bound on the pool's greedy F1 reads the pool's greedy rollouts
    with pytest.raises(InvalidArgument, match="stage34.pool.greedy=true"):
        Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={},
                stage34={"rl": {"pool_max_greedy_f1": 0.99}})
    Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={},
            stage34={"rl": {"pool_max_greedy_f1": 0.99}, "pool": {"greedy": True}})


def test_a_method_that_reads_with_another_models_trains_nothing_and_needs_that_model():
    from prorag.errors import InvalidArgument
    from prorag_app.profiles import PROFILES, Profile

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
    from prorag_app.profiles import PROFILES, with_overrides

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
