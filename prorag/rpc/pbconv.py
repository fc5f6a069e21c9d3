"""The one conversion between the core's types and the prorag.v1 messages that carry them.

Services and clients convert here only, so a field added to a proto or a core type is
wired once: documents (``Document`` <-> ``prorag.v1.Document`` / ``ScoredDocument``) and
token-level trajectories (``TokenTrajectory`` -> ``prorag.v1.TokenTrace``).
"""

from __future__ import annotations

from prorag.data.loaders import Document
from prorag.pb import common_pb2
from prorag.tokens import StepSpan, TokenTrajectory
from prorag.trajectory import Step, parse_step

STEP_KIND = {"subquery": common_pb2.STEP_KIND_SUBQUERY, "subanswer": common_pb2.STEP_KIND_SUBANSWER,
             "answer": common_pb2.STEP_KIND_ANSWER, "invalid": common_pb2.STEP_KIND_INVALID}
STEP_KIND_NAME = {v: k for k, v in STEP_KIND.items()}


def document_pb(d: Document) -> common_pb2.Document:
    return common_pb2.Document(id=d.id, title=d.title, text=d.text, contents=d.contents)


def scored_document_pb(d: Document) -> common_pb2.ScoredDocument:
    """The document with its ranking (rank 1-based; 0 and score 0.0 when it comes from no ranking)."""
    return common_pb2.ScoredDocument(document=document_pb(d), score=float(d.score), rank=int(d.rank))


def document_from_pb(m: common_pb2.Document) -> Document:
    return Document(id=m.id, title=m.title, text=m.text, contents=m.contents)


def scored_document_from_pb(m: common_pb2.ScoredDocument) -> Document:
    d = m.document
    return Document(id=d.id, title=d.title, text=d.text, contents=d.contents, score=float(m.score), rank=int(m.rank))


def step_pb(step: Step) -> common_pb2.Step:
    return common_pb2.Step(kind=STEP_KIND.get(step.kind, common_pb2.STEP_KIND_INVALID), thought=step.thought,
                           content=step.content, retrieved=[scored_document_pb(d) for d in step.docs or []],
                           text=step.text)


def step_from_pb(m: common_pb2.Step) -> Step:
    """A caller's step; an unspecified kind is parsed from its text (``text`` alone is enough), a subquery
    without documents has docs None (not searched yet)."""
    if m.kind == common_pb2.STEP_KIND_UNSPECIFIED:
        parsed = parse_step(m.text)
        if m.retrieved:
            parsed.docs = [scored_document_from_pb(d) for d in m.retrieved]
        return parsed
    kind = STEP_KIND_NAME.get(m.kind, "invalid")
    docs = [scored_document_from_pb(d) for d in m.retrieved] if kind == "subquery" and m.retrieved else None
    return Step(kind, thought=m.thought, content=m.content, docs=docs, text=m.text)


def token_trace_pb(t: TokenTrajectory) -> common_pb2.TokenTrace:
    """ids, generated mask, log-probs and each step's span; the loss weights stay with the trainer
    (they follow from the ids and the tag table)."""
    return common_pb2.TokenTrace(
        token_ids=t.token_ids, generated_mask=t.generated_mask, logprobs=t.logprobs,
        step_spans=[common_pb2.StepSpan(start=s.start, generated_end=s.generated_end, end=s.end) for s in t.spans])


def token_trace_from_pb(m: common_pb2.TokenTrace, prompt_length: int) -> TokenTrajectory:
    """A rollout's trace as a TokenTrajectory (loss weights 1.0 on generated tokens; a trainer that wants the
    format-aware weights recomputes them from the ids)."""
    mask = list(m.generated_mask)
    return TokenTrajectory(token_ids=list(m.token_ids), generated_mask=mask, weights=[float(x) for x in mask],
                           logprobs=list(m.logprobs), prompt_length=prompt_length,
                           spans=[StepSpan(s.start, s.generated_end, s.end) for s in m.step_spans])


__all__ = ["document_pb", "scored_document_pb", "document_from_pb", "scored_document_from_pb", "token_trace_pb",
           "token_trace_from_pb"]
