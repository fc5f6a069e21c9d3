"""One loader for real (FlashRAG / wiki-18 / BEIR) and embedded (``prorag world``) data.

Corpus rows are wiki-18 style ``{"id", "contents": "\\"Title\\"\\ntext"}`` (what the
Search-R1 ``/retrieve`` contract returns); rows with separate ``title``/``text``
fields (FlashRAG, BEIR) are accepted and given the same ``contents``.
:func:`parse_contents` and :func:`format_contents` are the only code that knows
this format.

Question rows are FlashRAG style ``{"id", "question", "golden_answers", "metadata"}``.
The loader tolerates what the FlashRAG copies of NQ, HotpotQA, 2Wiki, MuSiQue,
Bamboogle and PopQA carry (string or list answers, integer ids, missing or
arbitrary metadata) and keeps unknown metadata untouched.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from prorag.errors import InvalidArgument

__all__ = [
    "Document",
    "Question",
    "SubStep",
    "format_contents",
    "parse_contents",
    "iter_corpus",
    "load_corpus",
    "load_questions",
    "load_split",
]


# ----------------------------------------------------------------------------- contents format

def format_contents(title: str, text: str) -> str:
    """wiki-18 ``contents``: the title in double quotes on the first line, then the text.

    Titles are single-line by definition; any line break in one becomes a space so
    that :func:`parse_contents` always inverts this.
    """
    title = " ".join(str(title).splitlines())
    return f'"{title}"\n{text}'


def parse_contents(contents: str) -> tuple[str, str]:
    """``(title, text)`` from a wiki-18 ``contents`` string.

    A quoted first line is the title (one pair of surrounding quotes removed, inner
    quotes kept). An unquoted first line followed by more lines is still taken as
    the title, as FlashRAG does; a single unquoted line is all text.
    """
    first, sep, rest = contents.partition("\n")
    if len(first) >= 2 and first[0] == '"' and first[-1] == '"':
        return first[1:-1], rest
    if sep:
        return first, rest
    return "", contents


# ----------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Document:
    """One corpus passage, wherever it travels: read from a corpus, ranked by a retriever, shown
    to the policy inside a step. ``score``/``rank`` are set when it comes from a ranking."""

    id: str
    title: str
    text: str
    #: the exact string a retriever returns (kept as read, never re-formatted)
    contents: str
    #: higher = better, on the ranking retriever's own scale; 0.0 outside a ranking
    score: float = 0.0
    #: 1-based position in a ranking; 0 outside one
    rank: int = 0

    @classmethod
    def from_parts(cls, id: str, title: str, text: str, *, score: float = 0.0) -> "Document":
        return cls(id=str(id), title=title, text=text, contents=format_contents(title, text), score=score)

    @classmethod
    def from_contents(cls, id: str, contents: str) -> "Document":
        title, text = parse_contents(contents)
        return cls(id=str(id), title=title, text=text, contents=contents)

    @classmethod
    def from_row(cls, row: object, where: str = "row") -> "Document":
        """The one reader of a corpus row: ``{"id", "contents"}`` (wiki-18) or ``{"id", "title", "text"}``
        (FlashRAG, BEIR); ``_id``/``docid`` are accepted for the id. ``where`` ("file:line") prefixes every error."""
        if not isinstance(row, dict):
            raise InvalidArgument(f"{where}: expected a JSON object, got {type(row).__name__}")
        did = row.get("id", row.get("_id", row.get("docid")))
        if did is None:
            raise InvalidArgument(f"{where}: corpus row has no 'id'")
        contents = row.get("contents")
        if isinstance(contents, str):
            return cls.from_contents(did, contents)
        text = row.get("text")
        if isinstance(text, str):
            return cls.from_parts(did, str(row.get("title") or ""), text)
        raise InvalidArgument(f"{where}: corpus row has neither 'contents' nor 'text'")

    def to_row(self) -> dict:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True)
class SubStep:
    """One step of a gold decomposition; ``doc_id == ""`` marks a step needing no retrieval (a comparison)."""

    question: str
    answer: str
    answer_aliases: list[str] = field(default_factory=list)
    doc_id: str = ""
    title: str = ""

    @property
    def needs_retrieval(self) -> bool:
        return bool(self.doc_id or self.title)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_HOP_PREFIX = re.compile(r"^(\d+)hop")


@dataclass
class Question:
    id: str
    question: str
    golden_answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: dict, where: str = "row") -> "Question":
        """Build from one FlashRAG-style row; ``where`` ("file:line") prefixes every error."""
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        q = row.get("question")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{where}: row has no 'question' text")
        answers = None
        for key in ("golden_answers", "answers", "answer"):
            if key in row:
                answers = _answer_list(row[key])
                break
        if not answers:
            raise ValueError(f"{where}: row has no golden answers ('golden_answers' missing or empty)")
        meta = row.get("metadata")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):
            meta = {"value": meta}  # keep whatever it was rather than dropping it
        qid = row.get("id", row.get("_id"))
        if qid is None:
            raise ValueError(f"{where}: row has no 'id'")
        return cls(id=str(qid), question=q, golden_answers=answers, metadata=dict(meta))

    def to_row(self) -> dict:
        return {"id": self.id, "question": self.question, "golden_answers": list(self.golden_answers),
                "metadata": self.metadata}

    @property
    def qtype(self) -> str:
        """``metadata.type`` (compositional, comparison, bridge_comparison, HotpotQA's bridge, ...) or "unknown"."""
        t = self.metadata.get("type")
        return str(t) if t else "unknown"

    @property
    def decomposition(self) -> list[SubStep]:
        """Gold sub-steps: ours (``metadata.decomposition``) or MuSiQue's ``question_decomposition``; else []."""
        steps = self.metadata.get("decomposition")
        if isinstance(steps, list):
            out = []
            for s in steps:
                if not isinstance(s, dict):
                    continue
                ans = str(s.get("answer", ""))
                aliases = _answer_list(s.get("answer_aliases")) or ([ans] if ans else [])
                out.append(SubStep(question=str(s.get("question", "")), answer=ans, answer_aliases=aliases,
                                   doc_id=str(s.get("doc_id") or ""), title=str(s.get("title") or "")))
            return out
        steps = self.metadata.get("question_decomposition")
        if isinstance(steps, list):
            paragraphs = self.metadata.get("paragraphs")
            titles = {}
            if isinstance(paragraphs, list):
                for p in paragraphs:
                    if isinstance(p, dict) and "idx" in p:
                        titles[p["idx"]] = str(p.get("title", ""))
            out = []
            for s in steps:
                if not isinstance(s, dict):
                    continue
                ans = str(s.get("answer", ""))
                idx = s.get("paragraph_support_idx")
                out.append(SubStep(question=str(s.get("question", "")), answer=ans,
                                   answer_aliases=[ans] if ans else [],
                                   doc_id="" if idx is None else str(idx), title=titles.get(idx, "")))
            return out
        return []

    @property
    def hops(self) -> int:
        """Retrieval hops: ``metadata.hops``, else steps needing retrieval, MuSiQue's "2hop__" id prefix,
        or distinct supporting-fact titles (HotpotQA / 2Wiki); 1 when nothing says otherwise."""
        h = self.metadata.get("hops")
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
        steps = self.decomposition
        if steps:
            return sum(s.needs_retrieval for s in steps) or len(steps)
        m = _HOP_PREFIX.match(self.id)
        if m:
            return int(m.group(1))
        titles = _supporting_titles(self.metadata.get("supporting_facts"))
        return len(titles) if titles else 1

    @property
    def supporting_doc_ids(self) -> list[str]:
        ids = self.metadata.get("supporting_doc_ids")
        if isinstance(ids, list):
            return [str(i) for i in ids]
        seen: dict[str, None] = {}
        for s in self.decomposition:
            if s.doc_id:
                seen.setdefault(s.doc_id, None)
        return list(seen)


def _answer_list(value: Any) -> list[str]:
    """Golden answers as a list of non-empty strings (str, number or nested list accepted)."""
    if value is None:
        return []
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    out: list[str] = []
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, (list, tuple)):
                out.extend(_answer_list(v))
            elif v is not None and str(v).strip():
                out.append(str(v))
    return out


def _supporting_titles(sf: Any) -> list[str]:
    # HF/FlashRAG HotpotQA: {"title": [...], "sent_id": [...]}; original files: [[title, sent], ...]
    titles: list[str] = []
    if isinstance(sf, dict) and isinstance(sf.get("title"), list):
        titles = [str(t) for t in sf["title"]]
    elif isinstance(sf, list):
        titles = [str(x[0]) for x in sf if isinstance(x, (list, tuple)) and x]
    return list(dict.fromkeys(titles))


# ----------------------------------------------------------------------------- file reading

def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(``"file:line"``, row) for each non-blank JSONL line."""
    path = Path(path)
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def iter_corpus(path: str | Path) -> Iterator[Document]:
    """Stream documents from a ``.jsonl`` (or ``.jsonl.gz``) corpus."""
    for where, row in _rows(path):
        yield Document.from_row(row, where)


def load_corpus(path: str | Path) -> list[Document]:
    return list(iter_corpus(path))


def load_questions(path: str | Path, limit: int | None = None) -> list[Question]:
    """Questions from a FlashRAG-style ``.jsonl`` (or ``.jsonl.gz``); ``limit`` keeps the first n."""
    out: list[Question] = []
    for where, row in _rows(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(Question.from_row(row, where))
    return out


def load_split(world_dir: str | Path, split: str, limit: int | None = None) -> list[Question]:
    """``{world_dir}/{split}.jsonl``: an embedded world or a FlashRAG dataset folder (same layout).

    A world folder whose build did not finish (``world.json`` without ``DONE``) is refused.
    """
    d = Path(world_dir)
    if (d / "world.json").exists() and not (d / "DONE").exists():
        raise FileNotFoundError(f"{d}: world build incomplete (no DONE marker); run `prorag world` again")
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (d / name).exists():
            return load_questions(d / name, limit=limit)
    have = sorted(p.name for p in d.glob("*.jsonl*")) if d.is_dir() else []
    raise FileNotFoundError(f"{d}: no split {split!r} (found: {', '.join(have) or 'nothing'})")
