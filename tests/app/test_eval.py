"""prorag_app.eval and the pipeline's figure: the printed table and sft vs standard RAG on 2+ hops."""

import pytest

from prorag.evaluation import score_records
from prorag_app.eval import format_table
from prorag_app.pipeline import multi_hop_figure


def _records(spec):
    """spec: [(hops, type, f1)] -> records as run_agent/run_baseline produce them (em = f1 == 1)."""
    return [{"hops": h, "type": t, "f1": f, "em": float(f == 1.0)} for h, t, f in spec]


def test_pipeline_figure_compares_sft_with_standard_rag_on_two_plus_hops():
    sft = score_records(_records([(1, "compositional", 0.0)] * 5 + [(2, "compositional", 1.0)] * 30
                                 + [(3, "compositional", 0.0)] * 10))
    rag = score_records(_records([(1, "compositional", 1.0)] * 5 + [(2, "compositional", 0.0)] * 40))
    fig = multi_hop_figure({"sft": sft, "standard_rag": rag, "no_retrieval": rag})
    assert fig["group"] == "2+ hops" and fig["reached"]
    assert fig["sft_f1"] == pytest.approx(0.75) and fig["standard_rag_f1"] == 0.0
    assert multi_hop_figure({"sft": sft}) is None
    # the reverse comparison fails
    assert not multi_hop_figure({"sft": rag, "standard_rag": sft})["reached"]


def test_table_has_a_two_plus_hops_column():
    s = score_records(_records([(1, "compositional", 1.0), (2, "comparison", 0.5), (3, "compositional", 0.0)]))
    headers = [c.header for c in format_table({"m": s}).columns]
    assert "2+ hops" in headers
    assert headers.index("2+ hops") == headers.index("3-hop") + 1
    assert headers[1:3] == ["EM", "acc"]


def test_the_gate_verdict_carries_the_figures_it_read_and_one_line_says_what_it_decided():
    from prorag.prm.evaluation import HELD_OUT, UNSUPPORTED_FAMILIES
    from prorag_app.eval import gate_line, gate_verdict

    by_kind = {f: {"auc": 0.95, "n": 50} for f in UNSUPPORTED_FAMILIES}
    by_kind[HELD_OUT[1]] = {"auc": 0.9, "n": 40}  # a held-out family besides the unsupported ones
    passed = gate_verdict({"overall": 0.93, "by_kind": by_kind, "n": 140})
    assert passed["passed"] and passed["figures"] == {"overall": 0.93, **{f: 0.95 for f in UNSUPPORTED_FAMILIES}}
    line = gate_line(passed, "report")
    assert line.startswith("PRM gate on dev: passed") and "overall 0.930" in line and "ran all the same" in line
    by_kind[UNSUPPORTED_FAMILIES[-1]] = {"auc": 0.78, "n": 486}
    failed = gate_verdict({"overall": 0.92, "by_kind": by_kind, "n": 576})
    assert not failed["passed"] and failed["figures"][UNSUPPORTED_FAMILIES[-1]] == 0.78
    line = gate_line(failed, "enforce")
    assert "NOT passed" in line and "AUC 0.780" in line and "guides nothing" in line
