"""The stages that train on labelled sibling pairs (dpo, prm) refuse alike what they cannot train on: no pairs file,
no pair with the label they train by, a model that is not there."""

import json

import pytest

from prorag.config import from_dict
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.training.context import local_context
from services.trainer.stage_dpo import DPOConfig, run_dpo
from services.trainer.stage_prm import PRMConfig, run_prm
from tests.helpers import founder_pairs

#: stage -> (its runner, its config, the field naming the model it trains from, the label it trains by by default)
PAIRS_STAGES = {
    "dpo": (run_dpo, DPOConfig, "base_model", "value"),  # ReasonRAG's baseline: value labels, no judge
    "prm": (run_prm, PRMConfig, "policy_model", "judge"),
}


def pairs_job(config_cls, tmp_path, pairs: list, **fields):
    """A job of ``config_cls`` (DPO, PRM) on ``pairs`` (StepPair) written where it reads them: the tiny world, one
    thread, eight pairs a step, no checkpoints on the way."""
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in pairs))
    return from_dict(config_cls, {"world": "tiny", "pairs": str(pairs_file), "batch_size": 8, "threads": 1,
                                  "checkpoint_every": 1000, "max_len": 512, **fields})


def run_logging_bfloat16(run, cfg, work) -> dict:
    """``run``'s result on ``cfg`` in ``work``, after checking that every step it logged trained in bfloat16."""
    events = []
    out = run(local_context(work, cfg, emit=events.append))
    assert {e["metrics"]["dtype"] for e in events if e.get("loss") is not None} == {"bfloat16"}
    return out


@pytest.mark.parametrize("stage", sorted(PAIRS_STAGES))
def test_a_pairs_stage_refuses_what_it_cannot_train(stage, tiny_policy, tmp_path, monkeypatch):
    run, config_cls, model_field, label = PAIRS_STAGES[stage]
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    with pytest.raises(InvalidArgument, match="pairs file"):
        run(local_context(tmp_path / "a", from_dict(config_cls, {model_field: str(model_dir)})))
    unlabelled = tmp_path / "pairs.jsonl"
    # pairs labelled by the stage's label alone, that label then taken off: nothing to train by
    pairs = founder_pairs(4, judge=label == "judge", value=label == "value")
    unlabelled.write_text("".join(json.dumps({**p.to_dict(), f"{label}_choice": None}) + "\n" for p in pairs))
    with pytest.raises(FailedPrecondition, match=f"no {label}-labelled pairs"):
        run(local_context(tmp_path / "b", from_dict(config_cls, {"pairs": str(unlabelled),
                                                                 model_field: str(model_dir)})))
    with pytest.raises(InvalidArgument, match=model_field):
        run(local_context(tmp_path / "c", from_dict(config_cls, {"pairs": str(unlabelled), model_field: "nowhere"})))
