"""`prorag eval prm` on the tiny world: a published PRM validated on gold against corrupted steps of a split (test,
or dev where settings are chosen), AUC per family (in distribution and held out) and pooled, the gate's verdict
with its reasons, in the run's results.json and the printed JSON; the PNG written; an unknown PRM is a clear
error, not a traceback."""

from __future__ import annotations

import json

import pytest

from prorag.data.loaders import Document
from prorag.prm.evaluation import ProbeCase
from prorag.trajectory import Step
from prorag_app.embedded import ensure_policy_model, ensure_world
from prorag_app.eval import likelihood_cases


def test_eval_prm_writes_auc_per_kind_and_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    from prorag.modeling import save_pretrained
    from prorag.prm.evaluation import CORRUPTIONS, FAMILIES, HELD_OUT, prm_gate
    from prorag.prm.model import prm_from_policy
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
    # the keys outside tools read, as they were
    assert results["model"] == "prm@v1" and results["pairwise_accuracy"] == 0.75 and results["split"] == "test"
    assert auc["n"] == sum(v["n"] for v in auc["by_kind"].values()) > 0
    assert set(CORRUPTIONS) <= set(auc["by_kind"]) and all(0.0 <= v["auc"] <= 1.0 for v in auc["by_kind"].values())
    assert 0.0 <= auc["overall"] <= 1.0
    # additive: the held-out families beside them, pooled per group, the gate's verdict and what was dropped
    assert set(auc["by_kind"]) == set(FAMILIES)
    assert auc["in_distribution"]["kinds"] == list(CORRUPTIONS) and auc["held_out"]["kinds"] == list(HELD_OUT)
    assert auc["in_distribution"]["n"] + auc["held_out"]["n"] == auc["n"]
    assert auc["held_out"]["n"] == sum(auc["by_kind"][k]["n"] for k in HELD_OUT)
    # additive: the scores centred per step kind; a family of one kind keeps its AUC (both sides move alike)
    centred = results["auc_centred_per_kind"]
    assert set(centred["kind_means"]) <= {"subquery", "subanswer", "answer"} and 0.0 <= centred["overall"] <= 1.0
    for family in ("swapped_entity", "unsupported_subanswer", "redundant_search"):
        assert centred["by_kind"][family]["auc"] == pytest.approx(auc["by_kind"][family]["auc"])
    gate = results["gate"]
    assert (gate["passed"], gate["reasons"]) == prm_gate(auc)
    assert gate["min_unsupported"] == 0.8 and gate["min_overall"] == 0.9
    assert gate["unsupported_families"] == ["unsupported_subanswer", "in_document_distractor"]
    assert set(results["cases_dropped"]) == set(FAMILIES) and results["questions"] == 30
    assert (tmp_path / "out" / "prm" / "scores.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1])["prm"] == results
    assert "held out" in printed and "gate for PRM-guided stages" in printed and "centred per kind" in printed

    # on dev (where settings are chosen), a different set of questions
    assert main(["eval", "prm", "--world", "tiny", "--limit", "30", "--profile", "tiny", "--split", "dev", "--out",
                 str(tmp_path / "dev")]) == 0
    dev = json.loads((tmp_path / "dev" / "results.json").read_text())["prm"]
    assert dev["split"] == "dev" and dev["auc_gold_vs_corrupted"]["held_out"]["n"] > 0 and "gate" in dev
    capsys.readouterr()

    # the policy's own likelihood of each step on the same cases, beside the PRM's AUC (additive)
    base = str(ensure_policy_model("tiny"))
    assert main(["eval", "prm", "--world", "tiny", "--limit", "30", "--profile", "tiny", "--split", "dev",
                 "--reference-policy", base, "--out", str(tmp_path / "ref")]) == 0
    ref = json.loads((tmp_path / "ref" / "results.json").read_text())["prm"]
    likelihood = ref["reference_policy_likelihood"]
    assert likelihood["policy"] == base and likelihood["n"] == ref["auc_gold_vs_corrupted"]["n"]
    assert set(likelihood["by_kind"]) == set(FAMILIES) and 0.0 <= likelihood["overall"] <= 1.0
    assert ref["auc_gold_vs_corrupted"] == dev["auc_gold_vs_corrupted"]  # the PRM's figures as without it
    table = capsys.readouterr().out.strip().rsplit("\n", 1)[0]  # the printed table, the JSON line left out
    assert "likelihood" in table  # its column (the header may wrap)

    assert main(["eval", "prm", "--world", "tiny", "--model", "prm@nope", "--out", str(tmp_path / "o2")]) == 2
    assert "prm@nope" in capsys.readouterr().err


def test_likelihood_counts_the_written_tokens_from_where_the_steps_part(tmp_path, monkeypatch):
    """A case's two scores: the policy's log-likelihood of what each step writes after the shared context, the
    documents the environment inserts left out (a search scores the same with or without them), and the same
    whatever context both steps share."""
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    ensure_world("tiny")
    base = str(ensure_policy_model("tiny"))
    doc = Document.from_parts("d1", "Ana Berg", "Ana Berg was born in Oslo. She wrote two books.")
    search = Step("subquery", thought="One search to go.", content="Where was Ana Berg born?", docs=[doc])
    bare = Step("subquery", thought="One search to go.", content="Where was Ana Berg born?")
    other = Step("subquery", thought="One search to go.", content="Where was Oslo founded?", docs=[doc])
    said, wrong = (Step("subanswer", thought="The document says it.", content=c) for c in ("Oslo", "Bergen"))
    cases = [ProbeCase("q", "Where was Ana Berg born?", "x", 1, [search], said, wrong),
             ProbeCase("q", "Where was Ana Berg born?", "x", 0, [], search, other),
             ProbeCase("q", "Where was Ana Berg born?", "x", 0, [], bare, other)]
    gold, bad = likelihood_cases(base, cases)
    assert all(x < 0 for x in gold + bad)  # log-probabilities of at least one written token
    assert gold[1] == pytest.approx(gold[2], abs=1e-4)  # the inserted documents are not the policy's to write
    # a longer shared context changes what is predicted, not which tokens are counted: both steps part at the answer
    longer = ProbeCase("q", "Where was Ana Berg born?", "x", 2, [bare, search], said, wrong)
    g2, b2 = likelihood_cases(base, [longer])
    assert g2[0] < 0 and b2[0] < 0 and (g2[0], b2[0]) != (gold[0], bad[0])
