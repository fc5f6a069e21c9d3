"""Evaluation math: pure functions over ranked results and predictions (no I/O)."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from prorag.metrics import bootstrap_ci, cover_exact_match, seed_question_bootstrap_ci, summarize


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


#: the group the method comparisons of stages 3-4 are about (issue 19): questions of this many hops or more
COMPARISON_MIN_HOPS = 3


def paired_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], n_resamples: int = 2000,
                      alpha: float = 0.05, seed: int = 0) -> dict:
    """Method A minus method B over the same questions: the mean per-question difference and its paired 95%
    bootstrap CI.

    a, b: [n_seeds][n_questions] scores (e.g. F1), question j of every seed and of both methods being the same
    question. ``ci``: each question's difference is first averaged over the seeds, then the questions are
    resampled, so the interval reflects which questions were asked, and the seeds only reduce the per-question
    noise (``ci_includes_seeds`` False). ``ci_seeds_questions``: seeds resampled, then questions
    (prorag.metrics.seed_question_bootstrap_ci), so training noise is in the interval too; None with one seed,
    where there is no seed variance to measure.
    Returns {"f1_diff", "ci": [lo, hi], "ci_includes_seeds", "ci_seeds_questions", "n" (questions), "seeds",
    "a_mean", "b_mean", "wins", "losses", "ties"}.

    >>> r = paired_difference([[1.0, 0.5, 0.0]], [[0.5, 0.5, 0.0]])
    >>> round(r["f1_diff"], 4), r["n"], r["wins"], r["ties"]
    (0.1667, 3, 1, 2)
    """
    import numpy as np

    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.ndim != 2 or xa.shape != xb.shape:
        raise ValueError(f"a and b must both be [n_seeds][n_questions] of one shape, got {xa.shape} and {xb.shape}")
    if xa.shape[0] == 0 or xa.shape[1] == 0:
        raise ValueError("no seeds or no questions to compare")
    diff = (xa - xb).mean(axis=0)  # [n_questions]
    lo, hi = bootstrap_ci(diff, n_resamples=n_resamples, alpha=alpha, seed=seed)
    both = None
    if xa.shape[0] > 1:
        both = list(seed_question_bootstrap_ci(xa - xb, n_resamples=n_resamples, alpha=alpha, seed=seed))
    return {"f1_diff": float(diff.mean()), "ci": [lo, hi], "ci_includes_seeds": False, "ci_seeds_questions": both,
            "n": int(diff.size), "seeds": int(xa.shape[0]),
            "a_mean": float(xa.mean()), "b_mean": float(xb.mean()), "wins": int((diff > 1e-12).sum()),
            "losses": int((diff < -1e-12).sum()), "ties": int((np.abs(diff) <= 1e-12).sum())}


def compare_methods(per_question: dict[str, list[dict[str, float]]], hops: dict[str, int], pairs,
                    min_hops: int = COMPARISON_MIN_HOPS, seed: int = 0) -> dict[str, dict]:
    """Paired comparisons of methods on the questions of ``min_hops``+ hops.

    per_question: method -> [n_seeds] of {question id: F1}; hops: question id -> hop count; pairs: [(A, B)]
    method names. Only questions every seed of both methods answered are compared. Returns
    {"A_vs_B": {"group", "a", "b", "f1_diff", "ci", "n", "seeds", ...}} for each pair whose methods both exist
    and share seeds (a pair with a missing method is left out)."""
    out = {}
    for a_name, b_name in pairs:
        if a_name not in per_question or b_name not in per_question:
            continue
        runs_a, runs_b = per_question[a_name], per_question[b_name]
        seeds = min(len(runs_a), len(runs_b))
        if not seeds:
            continue
        runs_a, runs_b = runs_a[:seeds], runs_b[:seeds]
        ids = sorted(q for q in set.intersection(*(set(r) for r in (*runs_a, *runs_b)))
                     if hops.get(q, 0) >= min_hops)
        if not ids:
            continue
        r = paired_difference([[run[q] for q in ids] for run in runs_a], [[run[q] for q in ids] for run in runs_b],
                              seed=seed)
        out[f"{a_name}_vs_{b_name}"] = {"group": f"{min_hops}+ hops", "a": a_name, "b": b_name, **r}
    return out


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
