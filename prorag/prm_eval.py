"""Validation cases of a PRM: gold steps against corrupted ones at the same position of the same gold trajectory.

Four corruptions, the flaws ProRAG's judge rejects (prorag.judging): a subquery naming the wrong entity, a
sub-answer the documents do not support, a search repeated instead of the next hop's, and an answer given
before the last hop was searched. A PRM that separates sound from flawed steps scores each gold step above its
corrupted counterpart; the AUC per kind says how often. Pure functions: questions and documents in, cases out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from prorag.trajectory import Step

CORRUPTIONS = ("swapped_entity", "unsupported_subanswer", "redundant_search", "premature_answer")


@dataclass
class ProbeCase:
    """At ``position`` of question ``question_id``'s gold trajectory: the gold step and a ``kind`` corruption of
    it, both after the same ``context`` (the gold steps before)."""

    question_id: str
    question: str
    kind: str
    position: int
    context: list[Step]
    gold: Step
    corrupted: Step


def _swap(text: str, old: str, new: str) -> str | None:
    return text.replace(old, new) if old and old in text and old != new else None


def corrupt(question, steps: Sequence[Step], rng: random.Random, entities: Sequence[str],
            answers: Sequence[str]) -> list[ProbeCase]:
    """Every corruption that applies to ``steps`` (a gold trajectory: subquery, subanswer per hop, then the
    answer), at most one per kind, drawn with ``rng``.

    entities: names to swap into a subquery (any world entity); answers: sub-answers to put where the documents
    say something else (a replacement is never one the step's documents contain)."""
    from prorag.evaluation import question_entity

    hops = [s for s in question.decomposition if s.doc_id]
    subqueries = [i for i, s in enumerate(steps) if s.kind == "subquery"]
    subanswers = [i for i, s in enumerate(steps) if s.kind == "subanswer"]
    out: list[ProbeCase] = []

    def case(kind: str, pos: int, bad: Step) -> None:
        out.append(ProbeCase(question.id, question.question, kind, pos, list(steps[:pos]), steps[pos], bad))

    # swapped entity: the subquery asks about another entity than the one the question (or the last hop) names
    options = []
    for k, pos in enumerate(subqueries[:len(hops)]):
        named = question_entity(question) if k == 0 else hops[k - 1].answer
        others = [e for e in entities if e != named and e not in steps[pos].content]
        if others and named and named in steps[pos].content:
            options.append((pos, named, others))
    if options:
        pos, named, others = rng.choice(options)
        other = rng.choice(others)
        s = steps[pos]
        case("swapped_entity", pos, Step("subquery", thought=_swap(s.thought, named, other) or s.thought,
                                         content=s.content.replace(named, other)))
    # unsupported sub-answer: a name the documents just retrieved do not contain
    options = []
    for pos in subanswers:
        docs = steps[pos - 1].docs or []
        text = " ".join(f"{d.title} {d.text}" for d in docs)
        wrong = [a for a in answers if a and a != steps[pos].content and a not in text]
        if wrong:
            options.append((pos, wrong))
    if options:
        pos, wrong = rng.choice(options)
        case("unsupported_subanswer", pos, Step("subanswer", thought=steps[pos].thought, content=rng.choice(wrong)))
    # redundant search: the previous hop's subquery again instead of the next one
    later = subqueries[1:]
    if later:
        pos = rng.choice(later)
        prev = steps[max(p for p in subqueries if p < pos)]
        case("redundant_search", pos, Step("subquery", thought=steps[pos].thought, content=prev.content))
    # premature answer: answering with what is known so far while a hop is still to be searched; the thought is
    # the gold final answer's, so only the timing and the content give it away
    if later:
        pos = rng.choice(later)
        known = steps[pos - 1].content if steps[pos - 1].kind == "subanswer" else question_entity(question)
        final = steps[-1].thought if steps and steps[-1].kind == "answer" else ""
        case("premature_answer", pos, Step("answer", thought=final, content=known))
    return out


def auc_by_kind(cases: Sequence[ProbeCase], gold_scores: Sequence[float],
                corrupted_scores: Sequence[float]) -> dict:
    """{"overall": AUC, "<kind>": AUC, ...} of gold steps (positives) against corrupted ones (negatives), with
    ``n`` per kind. cases [N], gold_scores [N], corrupted_scores [N]: one pair of scores per case (the gold
    step is shared between kinds at one position; it is counted once per case, as its own contrast)."""
    from prorag.algorithms.prm import auc

    if not (len(cases) == len(gold_scores) == len(corrupted_scores)):
        raise ValueError("one gold and one corrupted score per case")
    out = {"overall": auc(list(gold_scores), list(corrupted_scores)), "n": len(cases), "by_kind": {}}
    for kind in CORRUPTIONS:
        idx = [i for i, c in enumerate(cases) if c.kind == kind]
        if idx:
            out["by_kind"][kind] = {"auc": auc([gold_scores[i] for i in idx], [corrupted_scores[i] for i in idx]),
                                    "n": len(idx)}
    return out


__all__ = ["CORRUPTIONS", "ProbeCase", "auc_by_kind", "corrupt"]
