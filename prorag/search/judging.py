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

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from prorag.data.loaders import Question
from prorag.errors import Unavailable
from prorag.jsontext import invalid_string
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


# ---------------------------------------------------------------- an LLM judge's request and reply
JUDGE_SYSTEM = (
    "You judge two alternative next steps of a retrieval-augmented reasoning agent that answers a multi-hop "
    "question by searching, reading and answering sub-questions. Both steps follow the same context. Choose the "
    "step that makes correct, efficient progress and reject the step that names a wrong entity, claims what the "
    "retrieved documents do not support, or repeats a search. If neither step is clearly better, decline. "
    'Reply with JSON only: {"chosen": 1 or 2 or null, "reason": "<one sentence>"}.')


def pair_messages(question: str, context: str, step_a: str, step_b: str) -> list[dict[str, str]]:
    """The chat request for one sibling pair (OpenAI message format)."""
    user = (f"Question: {question}\n\nContext so far:\n{context or '(nothing yet)'}\n\n"
            f"Step 1:\n{step_a}\n\nStep 2:\n{step_b}")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


class MalformedJudgeReply(Unavailable):
    """The judge endpoint answered, but not with a usable choice (the caller retries, counts, then gives up
    with UNAVAILABLE: a bad upstream, never a label)."""


_JSON_OBJECT = re.compile(r"\{.*\}", re.S)


def parse_pair_reply(text: str) -> PairJudgement:
    """{"chosen": 1 | 2 | null, "reason": ...} (also inside code fences or surrounding prose) -> PairJudgement
    over (step 1, step 2) as indices (0, 1). Anything else -> MalformedJudgeReply."""
    found = _JSON_OBJECT.search(text or "")
    if not found:
        raise MalformedJudgeReply(f"judge reply has no JSON object: {text[:200]!r}")
    try:
        reply = json.loads(found.group(0))
    except json.JSONDecodeError as e:
        raise MalformedJudgeReply(f"judge reply is not valid JSON ({e.msg}): {found.group(0)[:200]!r}") from None
    if not isinstance(reply, dict) or "chosen" not in reply:
        raise MalformedJudgeReply(f"judge reply lacks 'chosen': {found.group(0)[:200]!r}")
    bad = invalid_string(reply)  # a "\\ud800" escape: a reason that no cache file or RPC reply can carry
    if bad is not None:
        raise MalformedJudgeReply(f"judge reply: {bad[0]} {bad[1]}: {found.group(0)[:200]!r}")
    chosen, reason = reply["chosen"], str(reply.get("reason", ""))
    if chosen is None or (isinstance(chosen, str) and chosen.strip().lower() in ("", "null", "none")):
        return PairJudgement(None, None, reason or "declined")
    if isinstance(chosen, str) and chosen.strip() in ("1", "2"):
        chosen = int(chosen)
    if chosen not in (1, 2) or isinstance(chosen, bool):
        raise MalformedJudgeReply(f"judge chose {chosen!r}; the choices are 1, 2 or null")
    return PairJudgement(chosen - 1, 2 - chosen, reason)


def request_key(model: str, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any]) -> str:
    """Content key of one judge request (sha256 of its canonical JSON): the persistent cache's key, so the same
    question is never paid for twice."""
    blob = json.dumps({"model": model, "messages": list(messages), "params": dict(params)}, sort_keys=True,
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


__all__ = ["JUDGE_SYSTEM", "MalformedJudgeReply", "pair_messages", "parse_pair_reply", "request_key", "INVALID",
           "PairJudgement", "REDUNDANT_SEARCH", "UNSUPPORTED", "Verdict", "WRONG_ANSWER", "WRONG_ENTITY", "judge_pair",
           "judge_step", "open_hop"]
