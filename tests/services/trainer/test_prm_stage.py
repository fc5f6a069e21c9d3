"""The `prm` stage: Bradley-Terry on labelled sibling pairs learns a contrast it can see, holds questions out,
publishes to the PRM registry, and refuses what it cannot train on."""

import json

import pytest
import torch

from prorag.config import from_dict
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.search.pairs import prm_inputs
from prorag.prm.model import load_prm, score_batch
from prorag.registry import registry
from prorag.training.context import local_context
from services.trainer.stage_prm import PRMConfig, run_prm
from tests.helpers import founder_pairs

def _pairs(n, seed=0):
    return founder_pairs(n, seed, value=False)


def test_prm_stage_learns_publishes_and_scores(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, tok = tiny_policy
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in _pairs(80)))
    cfg = from_dict(PRMConfig, {"world": "tiny", "pairs": str(pairs_file), "policy_model": str(model_dir),
                                "holdout": 0.25, "epochs": 4, "batch_size": 8, "lr": 2e-3, "threads": 1,
                                "checkpoint_every": 1000, "max_len": 512})
    out = run_prm(local_context(tmp_path / "work", cfg))
    assert out["heldout_pairs"] > 5 and out["train_pairs"] + out["heldout_pairs"] == 80
    assert out["final_loss"] < 0.3  # from ln 2 = 0.69 at a random head
    assert out["heldout_pairwise_accuracy"] >= 0.9
    # per step kind too (these pairs are all sub-answers), adding up to the whole
    by_kind = {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith("heldout_pairs.")}
    assert by_kind == {"subanswer": out["heldout_pairs"]}
    assert out["heldout_pairwise_accuracy.subanswer"] == out["heldout_pairwise_accuracy"]
    published = registry("prm", "tiny").resolve(out["prm"])
    prm, ptok = load_prm(published)
    fresh = _pairs(1, seed=99)[0]
    chosen, rejected = fresh.steps[fresh.judge_choice], fresh.steps[1 - fresh.judge_choice]
    seqs = [prm_inputs(ptok, fresh.question, [*fresh.context, s]) for s in (chosen, rejected)]
    with torch.no_grad():
        sc = score_batch(prm, [s[0] for s in seqs], [[s[1][-1]] for s in seqs], 512, ptok.pad_token_id)
    assert float(sc[0][0]) > float(sc[1][0])


def test_prm_stage_refuses_what_it_cannot_train(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    with pytest.raises(InvalidArgument, match="pairs file"):
        run_prm(local_context(tmp_path / "a", from_dict(PRMConfig, {"policy_model": str(model_dir)})))
    unlabelled = tmp_path / "pairs.jsonl"
    unlabelled.write_text("".join(json.dumps({**p.to_dict(), "judge_choice": None}) + "\n" for p in _pairs(4)))
    with pytest.raises(FailedPrecondition, match="no judge-labelled pairs"):
        run_prm(local_context(tmp_path / "b", from_dict(PRMConfig, {"pairs": str(unlabelled),
                                                                    "policy_model": str(model_dir)})))
    with pytest.raises(InvalidArgument, match="policy_model"):
        run_prm(local_context(tmp_path / "c", from_dict(PRMConfig, {"pairs": str(unlabelled),
                                                                    "policy_model": "nowhere"})))


def test_prm_stage_trains_in_bfloat16_on_the_cpu_through_the_gpu_path(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in _pairs(24)))
    cfg = from_dict(PRMConfig, {"world": "tiny", "pairs": str(pairs_file), "policy_model": str(model_dir),
                                "holdout": 0.25, "epochs": 1, "batch_size": 8, "lr": 2e-3, "threads": 1,
                                "checkpoint_every": 1000, "max_len": 512, "dtype": "bfloat16", "log_every": 1})
    events = []
    out = run_prm(local_context(tmp_path / "work", cfg, emit=events.append))
    assert {e["metrics"]["dtype"] for e in events if e.get("loss") is not None} == {"bfloat16"}
    assert 0 < out["final_loss"] < float("inf") and "heldout_pairwise_accuracy" in out
    prm, _ = load_prm(registry("prm", "tiny").resolve(out["prm"]))
    assert next(prm.parameters()).dtype == torch.float32
