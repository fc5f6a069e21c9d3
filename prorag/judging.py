"""ProRAG's step-judging rules, checked against a benchmark's gold decomposition (the offline reference judge).

ProRAG's judge (GPT-4o) sees two sibling steps under one context and picks one chosen and one rejected, or
none: chosen = correct, efficient progress; rejected = wrong entity, unsupported claim, redundant search. Where
the benchmark carries its gold decomposition (the embedded worlds do), the same rules can be checked exactly:

- the *open hop* is the first gold hop whose answer no earlier subanswer has stated;
- a subquery is sound when it names the open hop's entity (its document's title) and repeats no earlier
  subquery; with no hop open, any further search is redundant;
- a subanswer is sound when it states the open hop's answer and that answer is in the documents the last
  search returned (otherwise: unsupported, or wrong);
- a final answer is sound when it matches a gold answer.

Pure functions; the judge service wraps them as its ``reference`` backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prorag.data.loaders import Question
from prorag.metrics import cover_exact_match, normalize_answer
from prorag.trajectory import Step

#: the reasons a step is judged unsound, as ProRAG's judging prompt names them
WRONG_ENTITY, REDUNDANT_SEARCH, UNSUPPORTED, WRONG_ANSWER, INVALID = (
    "wrong entity", "redundant search", "unsupported claim", "wrong answer", "invalid step")


@dataclass(frozen=True)
class Verdict:
    """sound: True (correct, efficient progress) or False (with its reason)."""

    sound: bool
    reason: str


@dataclass(frozen=True)
class PairJudgement:
    """chosen / rejected: indices (0 or 1) into the pair, both None when the judge declines."""

    chosen: int | None
    rejected: int | None
    reason: str


def _hop_answers(hop) -> list[str]:
    return [hop.answer, *hop.answer_aliases]


def open_hop(question: Question, history: Sequence[Step]) -> int | None:
    """Index of the first gold hop (needing retrieval) whose answer no earlier subanswer stated; None when
    every hop is answered (or the question has no decomposition)."""
    said = [s.content for s in history if s.kind == "subanswer"]
    for k, hop in enumerate(question.decomposition):
        if not hop.needs_retrieval:
            continue
        if not any(cover_exact_match(a, _hop_answers(hop)) == 1.0 for a in said):
            return k
    return None


def _last_docs(history: Sequence[Step]):
    for s in reversed(history):
        if s.kind == "subquery":
            return s.docs or []
    return []


def judge_step(question: Question, history: Sequence[Step], step: Step) -> Verdict:
    """Whether ``step``, taken after ``history``, is sound by the rules above."""
    if not step.valid:
        return Verdict(False, INVALID)
    hop_index = open_hop(question, history)
    hop = question.decomposition[hop_index] if hop_index is not None else None
    if step.kind == "subquery":
        earlier = {normalize_answer(s.content) for s in history if s.kind == "subquery"}
        if normalize_answer(step.content) in earlier or hop is None:
            return Verdict(False, REDUNDANT_SEARCH)
        entity = hop.title
        if entity and cover_exact_match(step.content, [entity]) != 1.0:
            return Verdict(False, WRONG_ENTITY)
        return Verdict(True, f"searches hop {hop_index + 1}'s entity {entity!r}")
    if step.kind == "subanswer":
        if hop is None:
            return Verdict(False, REDUNDANT_SEARCH)
        if cover_exact_match(step.content, _hop_answers(hop)) != 1.0:
            return Verdict(False, WRONG_ANSWER)
        docs = _last_docs(history)
        if not any(cover_exact_match(d.contents, [step.content]) == 1.0 for d in docs):
            return Verdict(False, UNSUPPORTED)
        return Verdict(True, f"answers hop {hop_index + 1} from the retrieved documents")
    # the final answer
    if cover_exact_match(step.content, question.golden_answers) == 1.0:
        return Verdict(True, "correct final answer")
    return Verdict(False, WRONG_ANSWER)


def judge_pair(question: Question, history: Sequence[Step], a: Step, b: Step) -> PairJudgement:
    """ProRAG's pair rule: one sound and one unsound step -> (chosen, rejected); otherwise the judge declines
    (both sound or both unsound is no contrast to learn from)."""
    va, vb = judge_step(question, history, a), judge_step(question, history, b)
    if va.sound and not vb.sound:
        return PairJudgement(0, 1, f"rejected: {vb.reason}")
    if vb.sound and not va.sound:
        return PairJudgement(1, 0, f"rejected: {va.reason}")
    return PairJudgement(None, None, "both sound" if va.sound else f"both unsound ({va.reason}; {vb.reason})")


__all__ = ["INVALID", "PairJudgement", "REDUNDANT_SEARCH", "UNSUPPORTED", "Verdict", "WRONG_ANSWER",
           "WRONG_ENTITY", "judge_pair", "judge_step", "open_hop"]
