"""The RFT stage against real retriever, policy and PRM servers on loopback, on the tiny world: questions drawn
evenly over hop counts, trajectories sampled through the policy, the correct ones scored step by step by the PRM
service in one call per chunk, the loss put on the steps that clear the threshold (filter=step) or the trajectory
kept only when every step clears it (filter=trajectory), and the policy fine-tuned on what was kept and published.

The policy server runs the MCTS test's scripted engine (GoldWalkEngine: steps that are right 60% of the time),
because a policy that answers correctly takes training a unit test cannot spend; everything else is real."""

from __future__ import annotations

import pytest
import torch

from prorag.config import from_dict
from prorag.errors import FailedPrecondition
from prorag.training.context import local_context
from tests.services.trainer.scripted_stack import stack_fixture, training_stage_config
from tests.services.trainer.test_mcts_stage import GoldWalkEngine


services = stack_fixture("rft", GoldWalkEngine)


def _config(services, **kw):
    from services.trainer.stage_rft import RFTConfig

    return training_stage_config(RFTConfig, services, **{
        "max_questions": 6, "samples_per_question": 8, "questions_per_request": 4, "max_train_steps": 2,
        "batch_size": 4, **kw})


def test_rft_keeps_correct_prm_approved_trajectories_and_publishes_a_model(services, tmp_path, one_thread):
    from prorag.metrics import exact_match
    from prorag.registry import registry
    from prorag.rollout import decode
    from prorag.trajectory import parse_trajectory
    from prorag.training.checkpoint import load_weights_file
    from services.trainer.stage_rft import run_rft

    # the fixture's PRORAG_DATA holds the world; the model is published there
    cfg = _config(services, prm_threshold=-1e9)  # every correct trajectory passes the PRM
    metrics = run_rft(local_context(tmp_path / "rft-prm", cfg, stage="rft"))
    assert metrics["data_sampled"] == 6 * 8 and metrics["data_answered"] <= 48
    assert 0 < metrics["data_correct"] == metrics["data_prm_scored"] == metrics["data_prm_passed"]
    assert 0 < metrics["data_kept"] <= metrics["data_correct"]
    assert metrics["prm_version"] and metrics["steps"] == 2
    assert registry("model", "tiny").resolve(metrics["model"]).is_dir()
    # what was kept is what the policy wrote, and it answers its question
    from transformers import AutoTokenizer

    from prorag import paths
    from prorag.data.loaders import load_split

    tok = AutoTokenizer.from_pretrained(services["base"])
    golds = {q.question: q.golden_answers for q in load_split(paths.world_dir("tiny"), "train")}
    blob = load_weights_file(tmp_path / "rft-prm" / "checkpoints" / "rft_data.pt")
    assert len(blob["samples"]) == metrics["data_kept"]
    for d in blob["samples"]:
        text = decode(tok, d["token_ids"][d["prompt_length"]:])
        steps = parse_trajectory(text)
        question = next(q for q in golds if q in decode(tok, d["token_ids"][:d["prompt_length"]]))
        assert steps[-1].kind == "answer" and exact_match(steps[-1].content, golds[question]) == 1.0
        # the loss is on generated tokens only, with the format-aware weights (5 on the answer tags)
        assert all(w == 0 for w, m in zip(d["weights"], d["generated_mask"]) if not m)
        assert max(d["weights"]) == 5.0


def test_a_threshold_no_step_reaches_keeps_nothing_and_says_why(services, tmp_path, one_thread):
    from services.trainer.stage_rft import run_rft

    with pytest.raises(FailedPrecondition, match="kept no trajectory.*prm_keep_fraction"):
        run_rft(local_context(tmp_path / "rft-none", _config(services, prm_threshold=1e9), stage="rft"))


def test_a_keep_fraction_lets_the_best_half_of_the_correct_trajectories_through(services, tmp_path, one_thread):
    """With prm_keep_fraction the threshold follows the PRM's own scale: however its logits are offset (this
    PRM's untrained head scores everything near one value), about that fraction of correct trajectories passes."""
    from services.trainer.stage_rft import run_rft

    # the split's first questions: their correct trajectories differ enough for the PRM to tell them apart
    cfg = _config(services, prm_keep_fraction=0.5, filter="trajectory", hop_balanced=False, max_train_steps=1)
    metrics = run_rft(local_context(tmp_path / "rft-half", cfg, stage="rft"))
    correct, passed = metrics["data_correct"], metrics["data_prm_passed"]
    assert correct > 1 and correct / 2 <= passed < correct  # ties at the threshold all pass
    assert metrics["data_prm_threshold"] > -1e9


def test_the_step_filter_puts_the_loss_on_the_steps_the_prm_approves_over_hop_balanced_questions(
        services, tmp_path, one_thread):
    """filter=step (the default), each kind's logits centred: every correct trajectory with a step at or above its
    kind's mean is kept, the loss only on those steps; the others stay in the sequence with weight 0."""
    from collections import Counter

    from prorag import paths
    from prorag.data.loaders import load_split
    from prorag.training.checkpoint import load_weights_file
    from services.trainer.stage_rft import run_rft

    cfg = _config(services, prm_centering="per_kind", prm_threshold=0.0, max_per_question=0, max_questions=16,
                  max_train_steps=1)
    assert (cfg.filter, cfg.hop_balanced) == ("step", True)
    metrics = run_rft(local_context(tmp_path / "rft-step", cfg, stage="rft"))
    # the 16 questions are drawn evenly over the train split's hop counts
    hops = Counter(q.hops for q in load_split(paths.world_dir("tiny"), "train"))
    drawn = {h: int(metrics.get(f"data_questions_hops_{h}", 0)) for h in hops}
    assert sum(drawn.values()) == 16 and set(drawn.values()) == {16 // len(hops)} and min(hops.values()) >= 4
    assert sum(metrics[f"data_kept_hops_{h}"] for h in drawn if drawn[h]) == metrics["data_kept"]
    # per kind, the best step is at or above the kind's mean: some step of every kind is kept, and not all steps
    kinds = [k[len("data_steps_total_"):] for k in metrics if k.startswith("data_steps_total_")]
    assert "answer" in kinds and "subquery" in kinds
    for k in kinds:
        assert 1 <= metrics[f"data_steps_kept_{k}"] <= metrics[f"data_steps_total_{k}"]
    kept_steps = sum(metrics[f"data_steps_kept_{k}"] for k in kinds)
    assert kept_steps < sum(metrics[f"data_steps_total_{k}"] for k in kinds)
    assert 0 < metrics["data_prm_passed"] <= metrics["data_correct"]
    assert metrics["data_kept"] + metrics["data_dropped_duplicate"] == metrics["data_prm_passed"]  # same texts once
    # in the saved data, a step carries the loss on all its generated tokens or on none, and the steps that carry
    # it are the ones counted as kept
    blob = load_weights_file(tmp_path / "rft-step" / "checkpoints" / "rft_data.pt")
    trained, masked = 0, 0
    for d in blob["samples"]:
        assert all(w == 0 for w, m in zip(d["weights"], d["generated_mask"]) if not m)
        for start, generated_end, _ in d["spans"]:
            ws = d["weights"][start:generated_end]
            assert all(w > 0 for w in ws) or all(w == 0 for w in ws)
            trained += ws[0] > 0
            masked += ws[0] == 0
        assert any(w > 0 for w in d["weights"])  # a trajectory with no kept step is not trained on
    assert trained == kept_steps and masked > 0


def test_kept_steps_by_filter_centring_and_keep_fraction():
    from services.trainer.stage_rft import RFTConfig, kept_steps

    def cfg(**kw):
        return from_dict(RFTConfig, {"base_model": "m", **kw})

    scores = [[1.7, 2.2], [1.9, 1.8], [-0.5, 3.0]]
    kinds = [["subquery", "subanswer"], ["subquery", "subanswer"], ["subquery", "answer"]]
    valid = [True, True, True]
    # step filter at logit 0: each step on its own
    assert kept_steps(cfg(), scores, kinds, valid, scored=True) == ([[True, True], [True, True], [False, True]], 0.0)
    # trajectory filter: all of a trajectory's steps or none
    assert kept_steps(cfg(filter="trajectory"), scores, kinds, valid, scored=True)[0] == [
        [True, True], [True, True], [False, False]]
    # centred per kind (subquery mean (1.7 + 1.9 - 0.5) / 3, subanswer 2.0, answer 3.0): steps above their mean
    flags, _ = kept_steps(cfg(prm_centering="per_kind"), scores, kinds, valid, scored=True)
    assert flags == [[True, True], [True, False], [False, True]]
    # a keep fraction over the steps: the best half of the 6 step scores (1.9 and up)
    flags, threshold = kept_steps(cfg(prm_keep_fraction=0.5), scores, kinds, valid, scored=True)
    assert threshold == 1.9 and flags == [[False, True], [True, False], [False, True]]
    # an invalid format keeps nothing; without a PRM every step of a valid trajectory is kept
    assert kept_steps(cfg(), scores, kinds, [True, False, True], scored=True)[0][1] == [False, False]
    assert kept_steps(cfg(), [[], [], []], kinds, [True, False, True], scored=False)[0] == [
        [True, True], [False, False], [True, True]]


def test_without_a_prm_the_outcome_alone_filters(services, tmp_path, one_thread):
    from services.trainer.stage_rft import run_rft

    metrics = run_rft(local_context(tmp_path / "rft-outcome", _config(services, prm="", max_train_steps=1),
                                    stage="rft"))
    assert metrics["data_prm_scored"] == 0 and metrics["data_prm_passed"] == metrics["data_correct"] > 0
    assert metrics["prm_version"] == ""


@pytest.mark.parametrize("split", ["test", "test_deep", "heldout_deep"])
def test_rft_never_trains_on_a_split_the_final_figures_are_read_on(services, split):
    from prorag.config import ConfigError

    with pytest.raises(ConfigError, match=f"RFT never trains on '{split}'"):
        _config(services, split=split)


def test_replay_mixes_in_gold_sft_trajectories_built_as_the_sft_job_built_them(services, tmp_path, one_thread):
    from prorag.config import from_dict as from_dict_
    from prorag.errors import FailedPrecondition
    from prorag.registry import registry
    from prorag.training.checkpoint import load_weights_file
    from services.trainer.stage_rft import run_rft
    from services.trainer.stage_sft import SFTConfig, run_sft

    # a base the SFT stage did not publish: there is no SFT data recipe to replay
    with pytest.raises(FailedPrecondition, match="replay"):
        run_rft(local_context(tmp_path / "rft-no-sft", _config(services, prm_threshold=-1e9, replay=1.0,
                                                                retriever=services["retriever"]), stage="rft"))
    sft_cfg = from_dict_(SFTConfig, {"mode": "agent", "world": "tiny", "retriever": services["retriever"],
                                     "base_model": services["base"], "max_questions": 8, "max_steps": 1,
                                     "batch_size": 2, "restate_question": True, "tracking": "local",
                                     "publish_name": "sft-for-replay"})
    sft = run_sft(local_context(tmp_path / "sft", sft_cfg, stage="sft"))
    sft_dir = str(registry("model", "tiny").resolve(sft["model"]))
    cfg = _config(services, base_model=sft_dir, prm_threshold=-1e9, replay=2.0, retriever=services["retriever"])
    metrics = run_rft(local_context(tmp_path / "rft-replay", cfg, stage="rft"))
    kept, replayed = int(metrics["data_kept"]), int(metrics["data_replayed"])
    assert kept > 0 and replayed == 2 * kept
    blob = load_weights_file(tmp_path / "rft-replay" / "checkpoints" / "rft_data.pt")
    assert len(blob["samples"]) == kept + replayed
    # the replayed trajectories are the SFT job's own data for the train split's first questions
    from transformers import AutoTokenizer

    from services.trainer.stage_sft import build_samples

    tok = AutoTokenizer.from_pretrained(sft_dir)
    gold, _ = build_samples(from_dict_(SFTConfig, {**sft_cfg.__dict__, "max_questions": replayed}), tok)
    assert [d["token_ids"] for d in blob["samples"][kept:]] == [g.token_ids for g in gold[:replayed]]


def test_rft_trains_in_bfloat16_on_the_cpu_through_the_gpu_path(services, tmp_path, one_thread):
    from safetensors.torch import load_file

    from prorag.registry import registry
    from services.trainer.stage_rft import run_rft

    events = []
    cfg = _config(services, prm_threshold=-1e9, dtype="bfloat16", log_every=1, publish_name="rft-bf16")
    out = run_rft(local_context(tmp_path / "rft-bf16", cfg, emit=events.append, stage="rft"))
    assert {e["metrics"]["dtype"] for e in events if e.get("loss") is not None} == {"bfloat16"}
    assert out["steps"] == 2 and 0 < out["final_loss"] < float("inf")
    weights = load_file(str(registry("model", "tiny").resolve(out["model"]) / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}
