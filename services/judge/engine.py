"""Judge engines. ``reference`` (the offline default) checks ProRAG's judging rules against the benchmark's gold
decomposition (prorag.judging); the ``openai`` backend arrives with the rest of stage 2 (ROADMAP)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prorag.data.loaders import Question, load_split
from prorag.errors import InvalidArgument, NotFound
from prorag.judging import judge_step
from prorag.metrics import normalize_answer
from prorag.trajectory import Step

SPLITS = ("train", "dev", "test")


@dataclass
class PairRequest:
    """One item: candidates are >= 2 sibling steps after ``history``."""

    id: str
    question_id: str
    question: str
    history: list[Step]
    candidates: list[Step]


@dataclass
class Judgement:
    id: str
    chosen: int  # -1 = none
    rejected: int  # -1 = none
    rationale: str


class ReferenceJudge:
    """Judges against the gold decompositions of one world's splits (found by question id, else by text)."""

    backend = "reference"
    model = "gold-decomposition"

    def __init__(self, questions: Sequence[Question]):
        self.by_id = {q.id: q for q in questions}
        self.by_text = {normalize_answer(q.question): q for q in questions}

    @classmethod
    def from_world(cls, world_dir: str | Path) -> "ReferenceJudge":
        world_dir = Path(world_dir)
        questions = [q for split in SPLITS if (world_dir / f"{split}.jsonl").is_file()
                     for q in load_split(world_dir, split)]
        if not questions:
            raise NotFound(f"no question splits under {world_dir}: the reference judge needs the gold decompositions")
        return cls(questions)

    def _question(self, item: PairRequest) -> Question:
        q = self.by_id.get(item.question_id) if item.question_id else None
        q = q or self.by_text.get(normalize_answer(item.question))
        if q is None:
            raise NotFound(f"item {item.id!r}: question {item.question_id or item.question!r} is not in the served "
                           f"world, so the reference judge has no gold decomposition for it")
        if not q.decomposition:
            raise InvalidArgument(f"item {item.id!r}: question {q.id} has no gold decomposition to judge against")
        return q

    def judge(self, items: Sequence[PairRequest]) -> list[Judgement]:
        out = []
        for item in items:
            q = self._question(item)
            verdicts = [judge_step(q, item.history, c) for c in item.candidates]
            sound = [i for i, v in enumerate(verdicts) if v.sound]
            unsound = [i for i, v in enumerate(verdicts) if not v.sound]
            if sound and unsound:
                c, r = sound[0], unsound[0]
                out.append(Judgement(item.id, c, r, f"candidate {c}: {verdicts[c].reason}; "
                                                    f"candidate {r}: {verdicts[r].reason}"))
            else:
                reasons = "; ".join(f"candidate {i}: {v.reason}" for i, v in enumerate(verdicts))
                out.append(Judgement(item.id, -1, -1, f"no contrast ({reasons})"))
        return out
