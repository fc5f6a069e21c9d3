"""The `prm` stage: Bradley-Terry on labelled sibling pairs learns a contrast it can see, holds questions out,
publishes to the PRM registry (what it refuses: test_pairs_stages)."""

import pytest
import torch

from prorag.config import ConfigError
from prorag.errors import FailedPrecondition
from prorag.search.pairs import prm_inputs, prm_rendering
from prorag.prm.model import likelihood_weight, load_prm, score_batch
from prorag.registry import registry
from prorag.training.context import local_context
from services.prm.engine import PRMEngine, ScoringItem
from services.trainer.stage_prm import PRMConfig, run_prm
from tests.helpers import founder_pairs
from tests.services.trainer.test_pairs_stages import pairs_job, run_logging_bfloat16

def _pairs(n, seed=0):
    return founder_pairs(n, seed, value=False)


def _job(tmp_path, model_dir, n_pairs: int, **fields) -> PRMConfig:
    """A PRM job on ``n_pairs`` judge-labelled pairs from the tiny policy at ``model_dir``, a quarter of their
    questions held out."""
    return pairs_job(PRMConfig, tmp_path, _pairs(n_pairs), policy_model=str(model_dir), holdout=0.25, lr=2e-3,
                     **fields)


def test_prm_stage_learns_publishes_and_scores(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, tok = tiny_policy
    cfg = _job(tmp_path, model_dir, 80, epochs=4)
    out = run_prm(local_context(tmp_path / "work", cfg))
    assert out["heldout_pairs"] > 5 and out["train_pairs"] + out["heldout_pairs"] == 80
    assert out["final_loss"] < 0.3  # from ln 2 = 0.69 at a random head
    assert out["heldout_pairwise_accuracy"] >= 0.9
    # per step kind too (these pairs are all sub-answers), adding up to the whole
    by_kind = {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith("heldout_pairs.")}
    assert by_kind == {"subanswer": out["heldout_pairs"]}
    assert out["heldout_pairwise_accuracy.subanswer"] == out["heldout_pairwise_accuracy"]
    # beside it, the policy's own likelihood on the same pairs before training (the tiny policy is untrained: its
    # preference is some figure in [0, 1]; the readout's exact value is tests/prm/test_model.py's)
    assert 0.0 <= out["heldout_policy_likelihood_accuracy"] <= 1.0
    assert set(k for k in out if k.startswith("heldout_policy_likelihood_accuracy.")) == \
        {"heldout_policy_likelihood_accuracy.subanswer"}
    published = registry("prm", "tiny").resolve(out["prm"])
    prm, ptok = load_prm(published)
    fresh = _pairs(1, seed=99)[0]
    chosen, rejected = fresh.steps[fresh.judge_choice], fresh.steps[1 - fresh.judge_choice]
    seqs = [prm_inputs(ptok, fresh.question, [*fresh.context, s]) for s in (chosen, rejected)]
    with torch.no_grad():
        sc = score_batch(prm, [s[0] for s in seqs], [[s[1][-1]] for s in seqs], 512, ptok.pad_token_id)
    assert float(sc[0][0]) > float(sc[1][0])


def test_verdict_weight_puts_accepted_steps_above_zero_and_rejected_below(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    out = run_prm(local_context(tmp_path / "work", _job(tmp_path, model_dir, 80, epochs=4, verdict_weight=1.0)))
    assert out["heldout_pairwise_accuracy"] >= 0.9
    # the share of held-out steps on their verdict's side of 0 (what the term is for; its effect across kinds is
    # tests/algorithms/test_prm.py's)
    assert out["heldout_verdict_accuracy"] >= 0.9


def test_likelihood_weight_trains_a_prm_that_the_engine_scores_with_its_readout(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    out = run_prm(local_context(tmp_path / "work", _job(tmp_path, model_dir, 80, epochs=4, likelihood_weight=1.0)))
    assert out["heldout_pairwise_accuracy"] >= 0.9
    published = registry("prm", "tiny").resolve(out["prm"])
    prm, ptok = load_prm(published)
    assert likelihood_weight(prm) == 1.0  # saved with the PRM: every scorer reads the same score
    fresh = _pairs(1, seed=98)[0]
    steps = [*fresh.context, fresh.steps[0]]
    ids, positions, written = prm_rendering(ptok, fresh.question, steps)
    with torch.no_grad():
        direct = [float(s) for s in score_batch(prm, [ids], [positions], 512, ptok.pad_token_id, written=[written])[0]]
    _, served = PRMEngine(published).score([ScoringItem(fresh.question, steps)])[0]
    assert served == pytest.approx(direct, abs=1e-4)


def test_likelihood_weight_is_refused_under_a_sharded_launch(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(FailedPrecondition, match="sharded"):
        run_prm(local_context(tmp_path / "work", _job(tmp_path, tiny_policy[0], 8, likelihood_weight=1.0)))


def test_verdict_weight_needs_the_judges_verdicts():
    with pytest.raises(ConfigError, match="verdict_weight"):
        PRMConfig(pairs="p.jsonl", policy_model="m", label_source="value", verdict_weight=1.0).validate()
    PRMConfig(pairs="p.jsonl", policy_model="m", label_source="both", verdict_weight=1.0).validate()


def test_prm_stage_trains_in_bfloat16_on_the_cpu_through_the_gpu_path(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    cfg = _job(tmp_path, model_dir, 24, epochs=1, dtype="bfloat16", log_every=1)
    out = run_logging_bfloat16(run_prm, cfg, tmp_path / "work")
    assert 0 < out["final_loss"] < float("inf") and "heldout_pairwise_accuracy" in out
    prm, _ = load_prm(registry("prm", "tiny").resolve(out["prm"]))
    assert next(prm.parameters()).dtype == torch.float32
