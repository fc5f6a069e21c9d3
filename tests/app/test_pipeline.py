"""`prorag run`'s job identity: reuse a finished job only for the same config and the same base weights."""

from pathlib import Path

from prorag_app.pipeline import job_id_for


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
    assert job_id_for("default", "sft", {**config, "lr": 1e-3}) != first
    fake_model(tmp_path / "policy-base", b"weights v2")  # base rebuilt in place: same path, new weights
    assert job_id_for("default", "sft", config) != first


def test_every_profile_is_a_valid_sft_and_warmup_config_and_variants_keep_their_own_base():
    from prorag.config import from_dict
    from prorag_app.embedded import policy_base_dir
    from prorag_app.pipeline import PROFILES
    from prorag.modeling import PRESETS, WarmupConfig
    from services.trainer.stage_sft import SFTConfig

    for name, prof in PROFILES.items():
        assert prof.model_preset in PRESETS, name
        for method in prof.methods:  # raises on unknown keys
            cfg = from_dict(SFTConfig, {"mode": "agent", "world": prof.world, **prof.sft_for(method)})
            assert cfg.max_steps > 0, (name, method)
        if prof.base_warmup is not None:
            from_dict(WarmupConfig, prof.base_warmup)
            # a profile with its own warm-up must not rebuild the base every other profile shares
            assert prof.base_variant and policy_base_dir(prof.world, prof.base_variant) != policy_base_dir(prof.world)


def test_a_method_trains_and_is_evaluated_with_its_own_settings_and_the_others_keep_the_shared_ones():
    from prorag_app.pipeline import Profile, eval_options

    prof = Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={"max_steps": 24, "topk": 3},
                   method_sft={"sft": {"topk": 1}}, max_steps=9)
    assert prof.sft_for("sft") == {"max_steps": 24, "topk": 1}
    assert prof.sft_for("standard_rag") == {"max_steps": 24, "topk": 3}
    assert eval_options("sft", prof) == {"topk": 1, "max_steps": 9}
    assert eval_options("standard_rag", prof) == {"topk": 3}
    # without a topk anywhere, evaluation uses the one SFT trained with by default
    from services.trainer.stage_sft import SFTConfig

    bare = Profile(world="tiny", model_preset="tiny", vocab_size=2048, sft={})
    assert eval_options("no_retrieval", bare) == {"topk": SFTConfig.topk}
