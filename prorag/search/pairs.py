"""Contrastive sibling steps (MCTS's output, the PRM's training data) and the PRM's one rendering.

A pair is two sibling steps under one context, with their tree statistics and up to two labels: by value
margin (ReasonRAG) and by a judge (ProRAG). The PRM sees a step exactly as a trajectory renders it
(prorag.data.sft.encode_segments: the agent prompt, the steps, the documents inserted after each search) and
is read at each step's last token (prorag.algorithms.prm.score_positions), so a pair's two sequences in
training and a whole trajectory in scoring put every step at the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from prorag.algorithms.prm import score_positions, written_positions
from prorag.data.loaders import Document
from prorag.data.sft import agent_prompt, encode_segments
from prorag.errors import InvalidArgument
from prorag.io import read_jsonl
from prorag.trajectory import KINDS, TAGS, Step


def step_to_dict(step: Step) -> dict:
    return {"kind": step.kind, "thought": step.thought, "content": step.content, "text": step.text,
            "docs": None if step.docs is None else [{**d.to_row(), "title": d.title, "text": d.text}
                                                     for d in step.docs]}


def step_from_dict(row: Mapping) -> Step:
    kind = row.get("kind")
    if kind not in (*KINDS, "invalid"):
        raise InvalidArgument(f"step kind {kind!r} is not one of {', '.join((*KINDS, 'invalid'))}")
    docs = row.get("docs")
    return Step(kind, thought=str(row.get("thought", "")), content=str(row.get("content", "")),
                text=str(row.get("text", "")),
                docs=None if docs is None else [Document.from_row(d, where="pair doc") for d in docs])


@dataclass
class StepPair:
    """Two sibling steps after ``context`` for question ``question_id``.

    values / visits: each sibling's mean backed-up value and visit count in the tree; value_choice /
    judge_choice: index (0 or 1) of the chosen sibling by value margin / by the judge, None = no label
    (margin too small, or the judge declined)."""

    question_id: str
    question: str
    context: list[Step]
    steps: tuple[Step, Step]
    values: tuple[float, float] = (0.0, 0.0)
    visits: tuple[int, int] = (0, 0)
    value_choice: int | None = None
    judge_choice: int | None = None
    judge_reason: str = ""
    meta: dict = field(default_factory=dict)

    def label(self, source: str) -> int | None:
        """The chosen index by "value", "judge", or "both" (only where the two agree)."""
        if source == "value":
            return self.value_choice
        if source == "judge":
            return self.judge_choice
        if source == "both":
            return self.value_choice if self.value_choice == self.judge_choice else None
        raise InvalidArgument(f"unknown label source {source!r} (known: value, judge, both)")

    def to_dict(self) -> dict:
        return {"question_id": self.question_id, "question": self.question,
                "context": [step_to_dict(s) for s in self.context], "steps": [step_to_dict(s) for s in self.steps],
                "values": list(self.values), "visits": list(self.visits), "value_choice": self.value_choice,
                "judge_choice": self.judge_choice, "judge_reason": self.judge_reason, "meta": self.meta}

    @classmethod
    def from_dict(cls, row: Mapping) -> "StepPair":
        steps = row.get("steps")
        if not isinstance(steps, list) or len(steps) != 2:
            raise InvalidArgument("a pair needs exactly two sibling steps")
        for key in ("value_choice", "judge_choice"):
            if row.get(key) not in (None, 0, 1):
                raise InvalidArgument(f"{key} must be 0, 1 or null, got {row.get(key)!r}")
        return cls(question_id=str(row.get("question_id", "")), question=str(row.get("question", "")),
                   context=[step_from_dict(s) for s in row.get("context") or []],
                   steps=(step_from_dict(steps[0]), step_from_dict(steps[1])),
                   values=tuple(float(v) for v in row.get("values", (0.0, 0.0))),
                   visits=tuple(int(v) for v in row.get("visits", (0, 0))),
                   value_choice=row.get("value_choice"), judge_choice=row.get("judge_choice"),
                   judge_reason=str(row.get("judge_reason", "")), meta=dict(row.get("meta") or {}))


def load_pairs(path: str) -> list[StepPair]:
    """The pairs of a JSONL file (the MCTS stage's output); InvalidArgument when there is no such file."""
    if not path or not Path(path).is_file():
        raise InvalidArgument(f"pairs file {path!r} does not exist (the MCTS stage writes one)")
    return [StepPair.from_dict(row) for row in read_jsonl(path)]


def label_agreement(pairs: Sequence[StepPair]) -> dict:
    """How often the judge and the value margin agree, over pairs both labelled: {"both_labelled",
    "agree", "agreement" (share), "value_only", "judge_only", "neither"}."""
    both = [p for p in pairs if p.value_choice is not None and p.judge_choice is not None]
    agree = sum(p.value_choice == p.judge_choice for p in both)
    return {"both_labelled": len(both), "agree": agree, "agreement": agree / len(both) if both else float("nan"),
            "value_only": sum(p.value_choice is not None and p.judge_choice is None for p in pairs),
            "judge_only": sum(p.judge_choice is not None and p.value_choice is None for p in pairs),
            "neither": sum(p.value_choice is None and p.judge_choice is None for p in pairs)}


def prm_rendering(tokenizer, question: str, steps: Sequence[Step]) -> tuple[list[int], list[int], list[list[int]]]:
    """The PRM's one rendering: (token ids [T], score positions [S], written [S]: per step the indices of the tokens
    the policy wrote, prorag.algorithms.prm.written_positions) of ``steps`` after ``question``'s agent prompt;
    training renders context + candidate, scoring a whole trajectory; a step's ids and position are the same in
    both."""
    if not steps:
        raise InvalidArgument("nothing to score: no steps")
    tag_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    traj = encode_segments(tokenizer, agent_prompt(question), steps, tag_ids, {})
    return list(traj.token_ids), score_positions(traj.spans), written_positions(traj.spans, traj.generated_mask)


def prm_inputs(tokenizer, question: str, steps: Sequence[Step]) -> tuple[list[int], list[int]]:
    """(token ids [T], score positions [S]) of :func:`prm_rendering`: for a head read at each step's last token."""
    ids, positions, _ = prm_rendering(tokenizer, question, steps)
    return ids, positions


def prompt_length(tokenizer, question: str) -> int:
    """Tokens of ``question``'s agent prompt: what left truncation keeps before any step."""
    return len(tokenizer.encode(agent_prompt(question), add_special_tokens=False))


__all__ = ["StepPair", "label_agreement", "load_pairs", "prm_inputs", "prm_rendering", "prompt_length",
           "step_from_dict", "step_to_dict"]
