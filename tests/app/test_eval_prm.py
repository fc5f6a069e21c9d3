"""`prorag eval prm` on the tiny world: a published PRM validated on gold against corrupted test steps, AUC per
kind in the run's results.json, the PNG written; an unknown PRM is a clear error, not a traceback."""

from __future__ import annotations

import json


def test_eval_prm_writes_auc_per_kind_and_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    from prorag.modeling import save_pretrained
    from prorag.prm_model import prm_from_policy
    from prorag.registry import ArtifactRef, registry
    from prorag_app.cli import main
    from prorag_app.embedded import ensure_policy_model, ensure_world

    ensure_world("tiny")
    prm, tok = prm_from_policy(ensure_policy_model("tiny"), seed=0)
    save_pretrained(prm, tok, tmp_path / "prm-dir")
    registry("prm", "tiny").publish(tmp_path / "prm-dir", ArtifactRef.of("prm", "v1"),
                                    metrics={"heldout_pairwise_accuracy": 0.75})

    assert main(["eval", "prm", "--world", "tiny", "--limit", "30", "--profile", "tiny", "--out",
                 str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())["prm"]
    auc = results["auc_gold_vs_corrupted"]
    assert results["model"] == "prm@v1" and results["pairwise_accuracy"] == 0.75
    assert auc["n"] == sum(v["n"] for v in auc["by_kind"].values()) > 0
    assert set(auc["by_kind"]) == {"swapped_entity", "unsupported_subanswer", "redundant_search", "premature_answer"}
    assert all(0.0 <= v["auc"] <= 1.0 for v in auc["by_kind"].values())
    assert (tmp_path / "out" / "prm" / "scores.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prm"]["model"] == "prm@v1"

    assert main(["eval", "prm", "--world", "tiny", "--model", "prm@nope", "--out", str(tmp_path / "o2")]) == 2
    assert "prm@nope" in capsys.readouterr().err
