"""Evaluation math: pure functions over ranked results and predictions (no I/O)."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from prorag.metrics import cover_exact_match, summarize


def recall_at_k(ranked: Sequence[Sequence[str]], gold: Sequence[set[str]], k: int) -> list[float]:
    """Per-query fraction of gold ids found in the top ``k``.

    ranked: [n_queries][>=k] doc ids, best first; gold: [n_queries] non-empty id sets.
    Returns [n_queries] floats in [0, 1].
    """
    if len(ranked) != len(gold):
        raise ValueError(f"{len(ranked)} rankings for {len(gold)} gold sets")
    out = []
    for ids, g in zip(ranked, gold):
        if not g:
            raise ValueError("a query has no gold documents")
        out.append(len(set(ids[:k]) & g) / len(g))
    return out


def grouped_mean_ci(values: Sequence[float], groups: Sequence[str], seed: int = 0) -> dict[str, dict]:
    """Mean and 95% bootstrap CI of ``values`` overall and per group label.

    values: [n]; groups: [n] labels. Returns {"overall": M, label: M...}, M = {"n", "mean", "ci"}.
    """
    by: dict[str, list[float]] = defaultdict(list)
    for v, g in zip(values, groups):
        by[g].append(v)
    out = {"overall": summarize(values, seed=seed)} if len(values) else {}
    for g in sorted(by, key=lambda s: (len(s), s)):
        out[g] = summarize(by[g], seed=seed)
    return out


def retrieval_queries(questions) -> tuple[list[dict], list[dict]]:
    """Two query sets from a split with gold decompositions.

    - subquery: one per hop, the gold sub-question (what a good agent would search), gold = that hop's doc;
    - question: one per question, the question itself (what standard RAG searches), gold = all supporting docs.
    Each item: {"query", "gold": set, "group"} where group is "hop 1", "hop 2", ... or "1-hop", "2-hop", ...
    """
    sub, whole = [], []
    for q in questions:
        decomposition = q.decomposition
        docs = {s.doc_id for s in decomposition if s.doc_id}
        for i, s in enumerate(decomposition):
            if s.doc_id:
                sub.append({"query": s.question, "gold": {s.doc_id}, "group": f"hop {i + 1}"})
        if docs:
            whole.append({"query": q.question, "gold": docs, "group": f"{q.hops}-hop" if q.qtype == "compositional"
                          else q.qtype})
    return sub, whole


def question_entity(question) -> str:
    """The entity a question starts from: the title of its first hop's document ("" without a decomposition)."""
    hops = [s for s in question.decomposition if s.doc_id]
    return hops[0].title if hops and getattr(hops[0], "title", "") else ""


def names_entity(text: str, entity: str) -> bool:
    """Whether ``text`` names ``entity`` as whole normalised tokens (an agent's first subquery should).

    >>> names_entity("Who founded Mai Brewery?", "Mai Brewery"), names_entity("Who founded Mai?", "Mai Brewery")
    (True, False)
    """
    return bool(entity) and cover_exact_match(text, [entity]) == 1.0


#: the group the SFT figure is about: questions of this many hops or more
MULTI_HOP_MIN = 2


def answer_stats(records: Sequence[dict], seed: int = 0) -> dict:
    """records: [{"em", "f1"[, "acc"]}] -> M = {"n", "em", "f1", "f1_ci", "em_ci"[, "acc"]}: means and 95% bootstrap
    CIs (one helper, :func:`prorag.metrics.summarize`, for every mean with a CI)."""
    em = summarize([r["em"] for r in records], seed=seed)
    f1 = summarize([r["f1"] for r in records], seed=seed)
    out = {"n": f1["n"], "em": em["mean"], "f1": f1["mean"], "f1_ci": f1["ci"], "em_ci": em["ci"]}
    if all("acc" in r for r in records):  # records written before acc existed carry none
        out["acc"] = summarize([r["acc"] for r in records], seed=seed)["mean"]
    return out


def score_records(records: list[dict]) -> dict:
    """records: [{"em", "f1", "acc", "hops", "type"}] -> {"overall": M, "by_hops": {h: M}, "by_type": {t: M},
    "multi_hop": M over questions of MULTI_HOP_MIN+ hops (None when there are none)}.

    M as :func:`answer_stats` gives it, CIs from one bootstrap of that group alone."""
    if not records:
        raise ValueError("no predictions to score")
    by_hops, by_type = defaultdict(list), defaultdict(list)
    for r in records:
        by_hops[str(r["hops"])].append(r)
        by_type[r["type"]].append(r)
    multi = [r for r in records if int(r["hops"]) >= MULTI_HOP_MIN]
    return {"overall": answer_stats(records), "by_hops": {h: answer_stats(rs) for h, rs in sorted(by_hops.items())},
            "by_type": {t: answer_stats(rs) for t, rs in sorted(by_type.items())},
            "multi_hop": answer_stats(multi) if multi else None}


def margin_beyond_cis(better: dict, baseline: dict) -> dict:
    """Whether ``better`` beats ``baseline`` by a margin larger than both 95% CIs (issue #4's figure).

    better/baseline: M dicts as score_records gives them ({"f1", "f1_ci"}). Reached when the margin
    of the means exceeds the full width of each interval, which for intervals of similar width also
    means they do not overlap; both conditions are required so a lopsided pair cannot pass on one.
    Returns {"margin", "better_ci_width", "baseline_ci_width", "cis_overlap", "reached"}.

    >>> a = {"f1": 0.30, "f1_ci": [0.25, 0.35]}
    >>> margin_beyond_cis(a, {"f1": 0.10, "f1_ci": [0.06, 0.14]})["reached"]
    True
    >>> margin_beyond_cis(a, {"f1": 0.22, "f1_ci": [0.18, 0.26]})["reached"]
    False
    """
    wa = better["f1_ci"][1] - better["f1_ci"][0]
    wb = baseline["f1_ci"][1] - baseline["f1_ci"][0]
    margin = better["f1"] - baseline["f1"]
    overlap = better["f1_ci"][0] <= baseline["f1_ci"][1]
    return {"margin": margin, "better_ci_width": wa, "baseline_ci_width": wb, "cis_overlap": overlap,
            "reached": bool(margin > max(wa, wb) and not overlap)}
