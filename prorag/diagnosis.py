"""Does RL sharpen, memorise or drift, and why are answers wrong? Pure functions over per-question evaluations
(issue 47: diagnose before tuning).

An RL adapter is read against the SFT agent it started from on two question sets: the pool questions RL trained
on, and unseen deep questions. On each, greedy F1 (what the evaluation reports) and sampled F1 at temperature 1
(what RL optimises), the sampled tokens' entropy, and wins and losses by the SFT agent's solve rate:

- **learns**: greedy F1 rises on the unseen questions (an interval above 0);
- **memorises**: greedy F1 rises on the pool questions (an interval above 0) and not on the unseen ones;
- **sharpens**: sampled F1 rises towards greedy F1 and the entropy falls, greedy F1 moving on neither set: RL
  makes the agent's samples agree with what greedy decoding already picked;
- **drifts**: greedy F1 falls on the unseen questions (an interval below 0);
- otherwise **no change** within the noise.

The entropy is the Monte Carlo estimate E[-log p(token)] over tokens sampled at temperature 1, which is the
per-token entropy of the policy's distribution in expectation; it needs only the sampled tokens' log-probs that
the policy service returns.

Why an answer is wrong (:data:`ANSWER_ERRORS`) is read from the trajectory the evaluation recorded against the
question's gold chain, with no model call: which kinds of error a model makes, and which an RL adapter fixes or
makes against the SFT agent (:func:`error_transitions`), say what RL could still teach.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from prorag.evaluation import names_entity
from prorag.metrics import exact_match

#: the SFT agent's solve rate (share of its samples that were right) split into bins: a bin's wins and losses
#: say where RL gains (questions it sometimes solved) and where it loses (questions it always solved)
SOLVE_RATE_BINS = ("never", "rarely", "often", "always")


def solve_rate_bin(rate: float) -> str:
    """"never" (0), "rarely" (at most half), "often" (more than half, not all), "always" (1).

    >>> [solve_rate_bin(r) for r in (0.0, 0.25, 0.5, 0.75, 1.0)]
    ['never', 'rarely', 'rarely', 'often', 'always']
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a solve rate is in [0, 1]; got {rate}")
    if rate == 0.0:
        return "never"
    if rate == 1.0:
        return "always"
    return "rarely" if rate <= 0.5 else "often"


def token_entropy(logprobs: Sequence[Sequence[float]]) -> float:
    """Mean -log p over every sampled token of every trajectory: logprobs [N][T_i] of tokens sampled at temperature
    1 -> nats per token (0 when there is no token).

    >>> round(token_entropy([[-0.5, -1.5], [-1.0]]), 3)
    1.0
    """
    flat = [-x for xs in logprobs for x in xs]
    return sum(flat) / len(flat) if flat else 0.0


def wins_losses_by_bin(model: Mapping[str, float], reference: Mapping[str, float], bins: Mapping[str, str],
                       eps: float = 1e-9) -> dict[str, dict]:
    """Per solve-rate bin, the questions where ``model``'s F1 beats, loses to or ties ``reference``'s.

    model, reference: question id -> F1 (greedy); bins: question id -> :data:`SOLVE_RATE_BINS` entry. Questions
    missing from either side are left out. Returns {bin: {"n", "wins", "losses", "ties", "diff"}} (diff: mean F1
    difference) for every bin, empty ones included (n 0, diff 0)."""
    out = {b: {"n": 0, "wins": 0, "losses": 0, "ties": 0, "diff": 0.0} for b in SOLVE_RATE_BINS}
    for q, b in bins.items():
        if q not in model or q not in reference:
            continue
        if b not in out:
            raise ValueError(f"question {q!r}: bin {b!r} is not one of {SOLVE_RATE_BINS}")
        d = model[q] - reference[q]
        row = out[b]
        row["n"] += 1
        row["diff"] += d
        row["wins" if d > eps else "losses" if d < -eps else "ties"] += 1
    for row in out.values():
        row["diff"] = row["diff"] / row["n"] if row["n"] else 0.0
    return out


def reading(pool_greedy_ci: Sequence[float] | None, unseen_greedy_ci: Sequence[float] | None,
            sampled_gain: float, entropy_change: float) -> str:
    """The verdict of the module docstring for one adapter: the 95% intervals of its greedy F1 minus the SFT agent's
    on the pool and unseen questions ([lo, hi], or None when not measured), its sampled F1 gain over the SFT
    agent's on both sets together, and its change in token entropy (nats; negative = sharper).

    >>> reading([0.01, 0.05], [-0.01, 0.02], 0.03, -0.1)
    'memorises'
    >>> reading([-0.01, 0.02], [-0.02, 0.02], 0.04, -0.2)
    'sharpens'
    """
    if unseen_greedy_ci is not None and unseen_greedy_ci[0] > 0:
        return "learns"
    if unseen_greedy_ci is not None and unseen_greedy_ci[1] < 0:
        return "drifts"
    if pool_greedy_ci is not None and pool_greedy_ci[0] > 0:
        return "memorises"
    if sampled_gain > 0 and entropy_change < 0:
        return "sharpens"
    return "no change"


#: why an answer is wrong, read along the question's gold chain at the first hop the agent never resolved (a hop is
#: resolved by a search that retrieves its gold document followed by a sub-answer naming its answer):
#: - right: the final answer's F1 is 1;
#: - broke_format: the generation left the step format (or ran out of steps) before resolving the hop;
#: - early_answer: the agent answered without searching for the hop;
#: - subquery_entity: its subquery for the hop missed the gold document and does not name the hop's entity (the gold
#:   document's title: the question's entity, or the previous hop's answer), so the query, not the index, failed;
#: - retrieval_miss: the subquery names the entity and the retriever still missed the document;
#: - wrong_fact: the gold document was read and the sub-answer is another fact of it (the subquery asked another
#:   relation of the right entity than the question's chain needs: the question was decomposed wrongly);
#: - misread: the gold document was read and the sub-answer is not in it (a garbled or invented span, or the
#:   hop's entity itself);
#: - final_answer: every hop resolved, the final answer still wrong.
ANSWER_ERRORS = ("right", "broke_format", "early_answer", "subquery_entity", "retrieval_miss", "wrong_fact",
                 "misread", "final_answer")


def _attempts(steps: Sequence[Mapping]) -> list[tuple[str, dict[str, str], str | None]]:
    """(subquery, {retrieved document id: its text}, the sub-answer after it or None) of each search of a
    trajectory."""
    out: list[tuple[str, dict[str, str], str | None]] = []
    for step in steps:
        kind = step.get("kind", "")
        if kind.endswith("SUBQUERY"):
            docs = {str((r.get("document") or {}).get("id", "")): str((r.get("document") or {}).get("text", ""))
                    for r in step.get("retrieved") or ()}
            out.append((str(step.get("content", "")), docs, None))
        elif kind.endswith("SUBANSWER") and out and out[-1][2] is None:
            q, docs, _ = out[-1]
            out[-1] = (q, docs, str(step.get("content", "")))
    return out


def gold_chain(metadata: Mapping) -> list[dict]:
    """The hops of a question's gold chain that read a document (its ``decomposition``'s entries with a doc_id; a
    comparison's last step compares the answers and reads none): the ``hops`` :func:`answer_error` reads, empty
    when the question carries no chain (an imported dataset without one)."""
    return [dict(h) for h in metadata.get("decomposition") or () if isinstance(h, Mapping) and h.get("doc_id")]


def _entity(hop: Mapping) -> str:
    """The entity a hop asks about: its document's title without a disambiguator ("Grethmouth (city)" ->
    "Grethmouth"), as a question names it."""
    return re.sub(r"\s*\([^)]*\)$", "", str(hop.get("title", "")))


def answer_error(steps: Sequence[Mapping], finish_reason: str, hops: Sequence[Mapping], f1: float) -> str:
    """One :data:`ANSWER_ERRORS` entry for one answered question.

    steps: the trajectory's steps as the evaluation records them [{"kind": "STEP_KIND_SUBQUERY" | ..., "content",
    "retrieved": [{"document": {"id", "text"}}]}]; finish_reason: "answer" when it ended in an answer; hops: the
    question's gold chain [{"doc_id", "title", "answer_aliases"}] (the world's ``decomposition``); f1: the final
    answer's F1. A search resolves whichever unresolved hop's document it retrieved (so comparison questions, whose hops
    have no order, are read too); a search that retrieved none is counted against the first unresolved hop. The verdict
    is the first failure at the first hop left unresolved.

    >>> hops = [{"doc_id": "P1", "title": "Ann Lee", "answer_aliases": ["Oslo"]},
    ...         {"doc_id": "C1", "title": "Oslo", "answer_aliases": ["Norway"]}]
    >>> search = lambda q, doc, sub: [{"kind": "STEP_KIND_SUBQUERY", "content": q,
    ...                                "retrieved": [{"document": {"id": doc, "text": "Ann Lee was born in Oslo. "
    ...                                                                            "She was a writer."}}]},
    ...                               {"kind": "STEP_KIND_SUBANSWER", "content": sub}]
    >>> answer_error(search("Where was Ann Lee born?", "P1", "Oslo") + search("Where is Osl?", "C9", "Peru"),
    ...              "answer", hops, 0.0)
    'subquery_entity'
    >>> answer_error(search("What was Ann Lee's job?", "P1", "writer"), "answer", hops, 0.0)
    'wrong_fact'
    >>> answer_error(search("Where was Ann Lee born?", "P1", "Ann Lee"), "answer", hops, 0.0)
    'misread'
    """
    if f1 >= 1.0 - 1e-9:
        return "right"
    unresolved = list(range(len(hops)))
    first_failure: dict[int, str] = {}
    for query, docs, subanswer in _attempts(steps):
        if not unresolved:
            break
        hop = next((j for j in unresolved if str(hops[j].get("doc_id")) in docs), None)
        if hop is None:
            j = unresolved[0]
            named = names_entity(query, _entity(hops[j]))
            first_failure.setdefault(j, "retrieval_miss" if named else "subquery_entity")
        elif subanswer is not None and exact_match(subanswer, list(hops[hop].get("answer_aliases") or ())) == 1.0:
            unresolved.remove(hop)
        elif subanswer is None:
            first_failure.setdefault(hop, "broke_format")
        else:
            text = docs[str(hops[hop].get("doc_id"))]
            other_fact = names_entity(text, subanswer) and not names_entity(subanswer, _entity(hops[hop]))
            first_failure.setdefault(hop, "wrong_fact" if other_fact else "misread")
    if not unresolved:
        return "final_answer" if finish_reason == "answer" else "broke_format"
    j = unresolved[0]
    return first_failure.get(j, "early_answer" if finish_reason == "answer" else "broke_format")


def error_transitions(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Question id -> :data:`ANSWER_ERRORS` entry of two models -> {kind before: {kind after: questions}}, over the
    questions both answered, every kind a row and a column: which errors a change fixed and which it made.

    >>> error_transitions({"a": "right", "b": "misread"}, {"a": "right", "b": "right"})["misread"]["right"]
    1
    """
    out = {k: {j: 0 for j in ANSWER_ERRORS} for k in ANSWER_ERRORS}
    for q, kind in before.items():
        if q in after:
            out[kind][after[q]] += 1
    return out


__all__ = ["ANSWER_ERRORS", "SOLVE_RATE_BINS", "answer_error", "error_transitions", "gold_chain", "reading",
           "solve_rate_bin", "token_entropy", "wins_losses_by_bin"]
