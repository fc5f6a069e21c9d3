"""Evaluation math: pure functions over ranked results and predictions (no I/O)."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from prorag.metrics import bootstrap_ci


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

    def stat(vs):
        lo, hi = bootstrap_ci(vs, seed=seed) if len(vs) > 1 else (vs[0], vs[0])
        return {"n": len(vs), "mean": sum(vs) / len(vs), "ci": [float(lo), float(hi)]}

    out = {"overall": stat(list(values))} if values else {}
    for g in sorted(by, key=lambda s: (len(s), s)):
        out[g] = stat(by[g])
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
