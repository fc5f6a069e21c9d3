"""The `prm` stage's ``extra_pairs``: a second pairs file (the siblings stage's beside the MCTS stage's) trained on
together with ``pairs``, checked like it at submission."""

import json

import pytest

from prorag.config import from_dict
from prorag.errors import InvalidArgument
from prorag.training.context import local_context
from services.trainer.stage_prm import PRMConfig, run_prm
from tests.helpers import founder_pairs


def _write(path, pairs):
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in pairs))
    return str(path)


def test_prm_trains_on_the_union_of_both_pair_files(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    pairs = founder_pairs(24, 0, value=False)
    base = {"world": "tiny", "policy_model": str(model_dir), "holdout": 0.25, "epochs": 0.2, "batch_size": 4,
            "threads": 1, "checkpoint_every": 1000, "max_len": 512}
    one = run_prm(local_context(tmp_path / "one", from_dict(PRMConfig, {
        **base, "pairs": _write(tmp_path / "a.jsonl", pairs[:10])})))
    both = run_prm(local_context(tmp_path / "both", from_dict(PRMConfig, {
        **base, "pairs": str(tmp_path / "a.jsonl"), "extra_pairs": _write(tmp_path / "b.jsonl", pairs[10:])})))
    assert one["train_pairs"] + one["heldout_pairs"] == 10
    assert both["train_pairs"] + both["heldout_pairs"] == 24
    with pytest.raises(InvalidArgument, match="pairs file"):
        run_prm(local_context(tmp_path / "missing", from_dict(PRMConfig, {
            **base, "pairs": str(tmp_path / "a.jsonl"), "extra_pairs": str(tmp_path / "nowhere.jsonl")})))


def test_extra_pairs_must_lie_in_the_data_root(tmp_path):
    from services.trainer.stages import check_job_config, get_stage

    stage = get_stage("prm")
    with pytest.raises(InvalidArgument, match="config.extra_pairs"):
        check_job_config(stage, {"pairs": str(tmp_path / "a.jsonl"), "extra_pairs": "/etc/passwd"},
                         roots=[tmp_path], allowed_endpoints=[])
    check_job_config(stage, {"pairs": str(tmp_path / "a.jsonl"), "extra_pairs": str(tmp_path / "b.jsonl")},
                     roots=[tmp_path], allowed_endpoints=[])
