"""Multi-hop QA datasets into the question format, each hop's supporting passage aligned to a corpus passage.

MuSiQue, 2WikiMultiHopQA and HotpotQA ship their own paragraphs, not ids of the corpus the retriever serves
(wiki-18). SFT's agent mode needs, for every retrieval hop of a question, the id of the corpus passage that
supports it (``metadata.decomposition[i].doc_id``), so an import:

1. reads each dataset in its own schema (the original files, JSON or JSONL, and FlashRAG's copies, which keep
   the question and golden answers and put the rest under ``metadata``: MuSiQue's with each step's supporting
   paragraph inside the step, 2Wiki's and HotpotQA's lists as dicts of lists) into :class:`SourceRecord`: the
   question, its answers, its hops (sub-question, sub-answer, the dataset's supporting paragraph) and every
   supporting paragraph;
2. aligns each supporting paragraph to a corpus passage (:func:`align_passages`): by title when exactly one
   corpus passage carries it, else by text through BM25 (the retriever's index), a hit kept only when it has
   the title or shares enough of the paragraph's words;
3. writes a question whose every retrieval hop aligned with its decomposition, and every other one with an
   empty decomposition: SFT drops it as it drops a question without one (``dropped_no_decomposition``).
   ``metadata.alignment`` says, per hop, what aligned, how, and why not.

HotpotQA has no decomposition: an optional teacher (any OpenAI-compatible chat endpoint) writes one, kept only
when each of its sub-questions retrieves a gold supporting passage, together they retrieve all of them, and
its final answer matches a golden answer (:func:`check_teacher_decomposition`).

Everything here is pure but :class:`OpenAITeacher`: the caller supplies the corpus passages by title and the
search function (``prorag data import`` wires the retriever's BM25 index).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import threading
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from prorag.config import cfg_field
from prorag.data.loaders import Document
from prorag.errors import InvalidArgument
from prorag.io import append_jsonl_synced, read_jsonl_journal
from prorag.metrics import exact_match, normalize_answer

__all__ = ["DATASETS", "Passage", "SourceHop", "SourceRecord", "Alignment", "AlignConfig", "ImportConfig",
           "read_records", "parse_record", "relation_question", "title_key", "index_titles", "text_overlap",
           "align_passages", "teacher_messages", "parse_teacher_reply", "check_teacher_decomposition",
           "OpenAITeacher", "import_records", "format_report"]

log = logging.getLogger("prorag.data.imports")

DATASETS = ("musique", "2wiki", "hotpotqa")

#: (queries, k) -> per query, up to k corpus passages, best first
SearchFn = Callable[[list[str], int], list[list[Document]]]
#: chat messages -> the reply's text (raises on a failed call)
TeacherFn = Callable[[list[dict]], str]


# ----------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Passage:
    """A dataset's own paragraph (title and text), before it is matched to a corpus passage."""

    title: str
    text: str


@dataclass(frozen=True)
class SourceHop:
    question: str
    answer: str
    answer_aliases: tuple[str, ...]
    #: the dataset's supporting paragraph; None when the record names none for this hop
    support: Passage | None


@dataclass(frozen=True)
class SourceRecord:
    """One dataset record, in the terms every dataset shares."""

    where: str  # "file:line" (JSONL) or "file: record n" (a JSON array)
    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]
    #: what SFT's thoughts follow: compositional (the answer is the last hop's), comparison, bridge_comparison
    type: str
    #: the dataset's own type (MuSiQue: its hop count, e.g. "2hop"; HotpotQA: bridge, comparison; 2Wiki: inference, ...)
    source_type: str
    #: the dataset's decomposition; None when it gives none (HotpotQA)
    hops: tuple[SourceHop, ...] | None
    #: every gold supporting paragraph, in the dataset's order
    supporting: tuple[Passage, ...]
    answerable: bool = True


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _raw_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for each record: a JSON array (HotpotQA's and 2Wiki's original files) or JSON lines."""
    with _open(path) as fh:
        head = ""
        while not head:
            ch = fh.read(1)
            if not ch:
                return
            head = ch.strip()
        fh.seek(0)
        if head == "[":
            try:
                rows = json.load(fh)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            for i, row in enumerate(rows, 1):
                yield f"{path}: record {i}", row
            return
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def read_records(path: str | Path, dataset: str, limit: int = 0) -> Iterator[SourceRecord]:
    """Records of ``dataset`` from ``path`` (``.json``, ``.jsonl``, either gzipped); ``limit`` > 0 keeps the first n."""
    if dataset not in DATASETS:
        raise InvalidArgument(f"unknown dataset {dataset!r}: one of {', '.join(DATASETS)}")
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"{path}: no such file")
    n = 0
    for where, row in _raw_rows(path):
        if limit and n >= limit:
            return
        yield parse_record(row, dataset, where)
        n += 1


def _flatten_flashrag(row: dict) -> dict:
    """FlashRAG's layout ({id, question, golden_answers, metadata: {the rest}}) as the original's flat record."""
    if isinstance(row.get("metadata"), dict) and "golden_answers" in row:
        return {**row["metadata"], "id": row.get("id", row["metadata"].get("id")), "question": row.get("question"),
                "golden_answers": row["golden_answers"]}
    return row


def _str(row: dict, key: str, where: str, dataset: str) -> str:
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise InvalidArgument(f"{where}: {dataset} record has no {key!r} text")
    return v.strip()


def _answers(row: dict, where: str, dataset: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in ("golden_answers", "answer", "answer_aliases"):
        v = row.get(key)
        for a in ([v] if isinstance(v, (str, int, float)) and not isinstance(v, bool) else v or []):
            if isinstance(a, (str, int, float)) and str(a).strip() and str(a).strip() not in out:
                out.append(str(a).strip())
    if not out:
        raise InvalidArgument(f"{where}: {dataset} record has no answer ('answer' or 'golden_answers')")
    return tuple(out)


def _list(row: dict, key: str, where: str, dataset: str) -> list:
    v = row.get(key)
    if not isinstance(v, list):
        raise InvalidArgument(f"{where}: {dataset} record's {key!r} must be a list, got "
                              f"{'nothing' if v is None else type(v).__name__}")
    return v


def _pairs(value: Any, second: tuple[str, ...], what: str, where: str) -> list[tuple[Any, Any]]:
    """[[a, b], ...] (the original files) or {"title": [...], <second>: [...]} (the Hugging Face copies)."""
    if isinstance(value, dict):
        key = next((k for k in second if k in value), None)
        if not isinstance(value.get("title"), list) or key is None or not isinstance(value[key], list) \
                or len(value[key]) != len(value["title"]):
            raise InvalidArgument(f"{where}: {what} must hold 'title' and {' or '.join(map(repr, second))} "
                                  "lists of one length")
        return list(zip(value["title"], value[key]))
    if isinstance(value, list) and all(isinstance(x, (list, tuple)) and len(x) >= 2 for x in value):
        return [(x[0], x[1]) for x in value]
    raise InvalidArgument(f"{where}: {what} must be [[title, ...], ...] or {{'title': [...], ...}}")


def _context(row: dict, where: str, dataset: str) -> dict[str, Passage]:
    """HotpotQA's and 2Wiki's ``context`` as title key -> paragraph (sentences joined)."""
    out: dict[str, Passage] = {}
    for title, sents in _pairs(row.get("context"), ("sentences", "content"), f"{dataset} 'context'", where):
        if isinstance(sents, str):
            sents = [sents]
        text = " ".join(str(s).strip() for s in sents if str(s).strip())
        out.setdefault(title_key(str(title)), Passage(str(title), text))
    return out


def _supporting_titles(row: dict, where: str, dataset: str) -> list[str]:
    pairs = _pairs(row.get("supporting_facts"), ("sent_id",), f"{dataset} 'supporting_facts'", where)
    return list(dict.fromkeys(str(t) for t, _ in pairs))


def _wiki_record(row: dict, where: str,
                 dataset: str) -> tuple[str, str, tuple[str, ...], dict[str, Passage], list[str]]:
    """What a HotpotQA and a 2Wiki record share: its id, question, golden answers, context paragraphs by title key
    and supporting titles."""
    qid = str(row.get("_id", row.get("id", "")))
    if not qid:
        raise InvalidArgument(f"{where}: {dataset} record has no '_id'")
    question, answers = _str(row, "question", where, dataset), _answers(row, where, dataset)
    return qid, question, answers, _context(row, where, dataset), _supporting_titles(row, where, dataset)


def _final_aliases(answer: str, answers: Sequence[str]) -> tuple[str, ...]:
    """A last hop's aliases: the question's golden answers too when the hop's answer is one of them."""
    if exact_match(answer, answers):
        return tuple(dict.fromkeys([answer, *answers]))
    return (answer,)


#: how a (subject, relation) pair is asked: MuSiQue's "X >> relation" sub-questions and 2Wiki's evidence triples
_PERSON_RELATIONS = {"director", "father", "mother", "spouse", "performer", "composer", "producer", "creator",
                     "child", "sibling", "author", "screenwriter", "editor", "cast member",
                     "lyricist", "publisher", "manufacturer", "developer", "employer", "doctoral advisor",
                     "student of", "head of government", "head of state"}
_RELATION_FORMS = {"date of birth": "When was {s} born?", "date of death": "When did {s} die?",
                   "place of birth": "Where was {s} born?", "place of death": "Where did {s} die?",
                   "publication date": "When was {s} published?", "inception": "When was {s} founded?",
                   "place of burial": "Where was {s} buried?", "founded by": "Who founded {s}?"}


def relation_question(subject: str, relation: str) -> str:
    """A direct question for one hop written as (subject, relation): "Who is the director of Jaws?"."""
    r, s = " ".join(relation.split()), " ".join(subject.split())
    form = _RELATION_FORMS.get(r.lower())
    if form:
        return form.format(s=s)
    return f"{'Who' if r.lower() in _PERSON_RELATIONS else 'What'} is the {r} of {s}?"


_HOP_REF = re.compile(r"#(\d+)")


def _paragraph(p: dict) -> Passage:
    return Passage(str(p.get("title", "")), str(p.get("paragraph_text", p.get("text", ""))))


def _musique(row: dict, where: str) -> SourceRecord:
    ds = "musique"
    qid, question, answers = str(row.get("id", "")), _str(row, "question", where, ds), _answers(row, where, ds)
    if not qid:
        raise InvalidArgument(f"{where}: musique record has no 'id'")
    steps = _list(row, "question_decomposition", where, ds)
    # the original files hold every paragraph beside the decomposition; FlashRAG's copy drops them and keeps each
    # step's supporting one inside the step ("support_paragraph")
    inline = bool(steps) and all(isinstance(s, dict) and isinstance(s.get("support_paragraph"), dict) for s in steps)
    paragraphs: dict[int, Passage] = {}
    for p in ([] if inline else _list(row, "paragraphs", where, ds)):
        if not isinstance(p, dict) or not isinstance(p.get("idx"), int):
            raise InvalidArgument(f"{where}: musique paragraph without an integer 'idx': {str(p)[:80]}")
        paragraphs[p["idx"]] = _paragraph(p)
    hops: list[SourceHop] = []
    sub_answers: list[str] = []
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or not isinstance(s.get("question"), str):
            raise InvalidArgument(f"{where}: musique question_decomposition[{i}] has no 'question'")
        answer = str(s.get("answer", "")).strip()

        def earlier(m: re.Match) -> str:
            k = int(m.group(1))
            return sub_answers[k - 1] if 1 <= k <= len(sub_answers) else m.group(0)

        # later hops name earlier answers as "#1": the subquery the agent writes names the entity itself
        q = _HOP_REF.sub(earlier, s["question"]).strip()
        if ">>" in q:  # "X >> relation": a relation of X, written as a question
            subject, _, relation = q.partition(">>")
            q = relation_question(subject.strip(), relation.strip())
        idx = s.get("paragraph_support_idx")
        if inline:
            support = _paragraph(s["support_paragraph"])
        else:
            support = paragraphs.get(idx) if isinstance(idx, int) else None
        aliases = _final_aliases(answer, answers) if i == len(steps) - 1 else ((answer,) if answer else ())
        hops.append(SourceHop(q, answer, aliases, support))
        sub_answers.append(answer)
    supporting = tuple(dict.fromkeys(h.support for h in hops if h.support is not None))
    m = re.match(r"^(\d+hop)", qid)
    return SourceRecord(where, ds, qid, question, answers, "compositional", m.group(1) if m else f"{len(hops)}hop",
                        tuple(hops) or None, supporting, answerable=row.get("answerable", True) is not False)


def _two_wiki(row: dict, where: str) -> SourceRecord:
    ds = "2wiki"
    qid, question, answers, context, titles = _wiki_record(row, where, ds)
    supporting = tuple(context[title_key(t)] for t in titles if title_key(t) in context)
    source_type = str(row.get("type", ""))
    qtype = source_type if source_type in ("comparison", "bridge_comparison") else "compositional"
    evidences = row.get("evidences") or []
    # the Hugging Face / FlashRAG copy: {"fact": [...], "relation": [...], "entity": [...]}
    if isinstance(evidences, dict):
        cols = [evidences.get(k) for k in ("fact", "relation", "entity")]
        if not all(isinstance(c, list) and len(c) == len(cols[0]) for c in cols):
            raise InvalidArgument(f"{where}: 2wiki 'evidences' must hold 'fact', 'relation' and 'entity' lists of "
                                  "one length")
        evidences = [list(t) for t in zip(*cols)]
    if not isinstance(evidences, list) or not all(isinstance(e, (list, tuple)) and len(e) == 3 for e in evidences):
        raise InvalidArgument(f"{where}: 2wiki 'evidences' must be [[subject, relation, object], ...]")
    hops: list[SourceHop] = []
    for i, (subject, relation, obj) in enumerate(evidences):
        support = context.get(title_key(str(subject)))
        if support is None and len(evidences) == len(supporting):
            # an evidence's subject usually is its page's title; where it is not, the supporting facts are in
            # the evidences' order
            support = supporting[i]
        last = i == len(evidences) - 1 and qtype == "compositional"
        hops.append(SourceHop(relation_question(str(subject), str(relation)), str(obj),
                              _final_aliases(str(obj), answers) if last else (str(obj),), support))
    return SourceRecord(where, ds, qid, question, answers, qtype, source_type, tuple(hops) or None, supporting)


def _hotpotqa(row: dict, where: str) -> SourceRecord:
    ds = "hotpotqa"
    qid, question, answers, context, titles = _wiki_record(row, where, ds)
    missing = [t for t in titles if title_key(t) not in context]
    if missing:
        raise InvalidArgument(f"{where}: hotpotqa supporting fact titles {missing} are not in its 'context'")
    source_type = str(row.get("type", ""))
    return SourceRecord(where, ds, qid, question, answers, "comparison" if source_type == "comparison" else
                        "compositional", source_type, None, tuple(context[title_key(t)] for t in titles))


_PARSERS = {"musique": _musique, "2wiki": _two_wiki, "hotpotqa": _hotpotqa}


def parse_record(row: Any, dataset: str, where: str = "record") -> SourceRecord:
    """One record of ``dataset`` in its original schema or FlashRAG's; errors name ``where``."""
    if dataset not in _PARSERS:
        raise InvalidArgument(f"unknown dataset {dataset!r}: one of {', '.join(DATASETS)}")
    if not isinstance(row, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(row).__name__}")
    return _PARSERS[dataset](_flatten_flashrag(row), where)


# ----------------------------------------------------------------------------- alignment

@dataclass(frozen=True)
class Alignment:
    doc_id: str = ""
    #: "title" (the one corpus passage of that title), "text" (chosen by its text through BM25), "" (none)
    by: str = ""
    #: why it did not align
    reason: str = ""
    #: the corpus passage's title and text (the text for the sub-answer check)
    title: str = ""
    text: str = ""


@dataclass
class AlignConfig:
    text_candidates: int = cfg_field(20, help="BM25 hits read per paragraph when its title does not settle it",
                                     min=1, max=1000)
    min_text_overlap: float = cfg_field(0.5, help="a hit of another title is kept when it shares at least this share "
                                                  "of the shorter side's word pairs (see text_overlap)",
                                        min=0.0, max=1.0)


def title_key(title: str) -> str:
    """Titles compared case- and Unicode-form-insensitively, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFC", str(title)).casefold().split())


def index_titles(docs: Iterable[Document], wanted: set[str]) -> dict[str, list[Document]]:
    """title key -> the corpus passages of that title, for the wanted keys only (one pass over a large corpus)."""
    out: dict[str, list[Document]] = {}
    for d in docs:
        k = title_key(d.title)
        if k in wanted:
            out.setdefault(k, []).append(d)
    return out


def _words(text: str) -> set[str]:
    return set(normalize_answer(text).split())


def _word_pairs(text: str) -> set[tuple[str, str]]:
    w = normalize_answer(text).split()
    return set(zip(w, w[1:]))


def text_overlap(a: str, b: str) -> float:
    """Distinct adjacent word pairs (SQuAD-normalised) shared, over the shorter side's: 1.0 when one text holds
    the other's.

    Why pairs: two passages about related entities share many single words ("his father was the merchant ...")
    but few pairs; copies of one text share most. Why the shorter side: a dataset paragraph and a 100-word
    wiki-18 passage cut the same article differently, so either may hold the other."""
    pa, pb = _word_pairs(a), _word_pairs(b)
    if not pa or not pb:
        return 0.0
    return len(pa & pb) / min(len(pa), len(pb))


def align_passages(passages: Iterable[Passage], titled: Mapping[str, Sequence[Document]], search: SearchFn,
                   cfg: AlignConfig | None = None, batch: int = 256) -> dict[Passage, Alignment]:
    """Each distinct paragraph -> the corpus passage it is, or why none is.

    By title: exactly one corpus passage carries the paragraph's title. Otherwise by text: the paragraph (title
    and text) is searched through BM25, and the best hit that shares at least ``min_text_overlap`` of its text
    (:func:`text_overlap`) is taken, of the same title when the corpus has that title (one article cut into
    several passages), of any title when it has not (a renamed article); failing that, the passage of the same
    title that shares most of its text, if it shares enough.
    """
    cfg = cfg or AlignConfig()
    out: dict[Passage, Alignment] = {}
    pending: list[Passage] = []
    for p in dict.fromkeys(passages):
        same = titled.get(title_key(p.title), ())
        if len(same) == 1:
            out[p] = Alignment(same[0].id, "title", title=same[0].title, text=same[0].text)
        else:
            pending.append(p)
    for i in range(0, len(pending), batch):
        chunk = pending[i:i + batch]
        for p, hits in zip(chunk, search([f"{p.title} {p.text}" for p in chunk], cfg.text_candidates)):
            same = titled.get(title_key(p.title), ())
            ids = {d.id for d in same}
            close = [h for h in hits if text_overlap(p.text, h.text) >= cfg.min_text_overlap]
            hit = next((h for h in close if h.id in ids), None) if same else next(iter(close), None)
            if hit is None and same:  # the right passage of a long article may rank below other articles' ones
                best = max(same, key=lambda d: text_overlap(p.text, d.text))
                hit = best if text_overlap(p.text, best.text) >= cfg.min_text_overlap else None
            if hit is not None:
                out[p] = Alignment(hit.id, "text", title=hit.title, text=hit.text)
            elif same:
                out[p] = Alignment(reason=f"none of the corpus's {len(same)} passages titled {p.title!r} matches "
                                          "the paragraph's text")
            else:
                out[p] = Alignment(reason=f"no corpus passage is titled {p.title!r} and none of the top "
                                          f"{cfg.text_candidates} BM25 hits shares {cfg.min_text_overlap:.0%} of "
                                          "the paragraph's word pairs")
    return out


# ----------------------------------------------------------------------------- teacher

_TEACHER_INSTRUCTION = (
    "Break the question into the single-fact sub-questions one would search for, in order, each answered by one "
    "of the paragraphs below. Write each sub-question so it stands alone: name the entity, never 'it' or '#1'. "
    "Do not add a sub-question for a final comparison. Reply with JSON only: "
    '{"steps": [{"question": "...", "answer": "..."}], "answer": "the final short answer"}.')


def teacher_messages(question: str, paragraphs: Sequence[Passage]) -> list[dict]:
    """The teacher's chat request: the question and its gold supporting paragraphs (never its answer, which the
    reply is checked against)."""
    ctx = "\n".join(f"Paragraph {i} (Title: {p.title}) {p.text}" for i, p in enumerate(paragraphs, 1))
    return [{"role": "system", "content": _TEACHER_INSTRUCTION},
            {"role": "user", "content": f"{ctx}\n\nQuestion: {question}"}]


def parse_teacher_reply(text: str, max_steps: int = 6) -> tuple[list[tuple[str, str]], str]:
    """([(sub-question, sub-answer)], final answer) from the teacher's reply (prose around the JSON is allowed);
    ValueError says what is wrong."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the reply")
    try:
        obj = json.loads(text[start:end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"the reply's JSON does not parse ({e.msg})") from None
    steps, answer = (obj.get("steps"), obj.get("answer")) if isinstance(obj, dict) else (None, None)
    if not isinstance(steps, list) or not steps or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise ValueError("the reply needs a non-empty 'steps' list and an 'answer'")
    if len(steps) > max_steps:
        raise ValueError(f"{len(steps)} steps, more than {max_steps}")
    out = []
    for s in steps:
        if not isinstance(s, dict) or not str(s.get("question", "")).strip() or not str(s.get("answer", "")).strip():
            raise ValueError("each step needs a 'question' and an 'answer'")
        out.append((" ".join(str(s["question"]).split()), str(s["answer"]).strip()))
    return out, str(answer).strip()


def check_teacher_decomposition(record: SourceRecord, steps: Sequence[tuple[str, str]], answer: str,
                                supporting_ids: Sequence[str], search: SearchFn,
                                topk: int) -> tuple[list[SourceHop], list[str]] | str:
    """A teacher's decomposition as hops with their supporting doc ids, or why it is rejected.

    Kept only when the final answer matches a golden answer (SQuAD-normalised exact match), each sub-question's
    top ``topk`` hits hold a gold supporting passage (the first such becomes its support), and the sub-questions
    together retrieve every gold supporting passage."""
    if not exact_match(answer, record.answers):
        return f"the teacher's answer {answer!r} matches no golden answer"
    gold = set(supporting_ids)
    hops, doc_ids, found = [], [], set()
    for n, (hits, (q, a)) in enumerate(zip(search([q for q, _ in steps], topk), steps), 1):
        hit = next((h for h in hits if h.id in gold), None)
        if hit is None:
            return f"sub-question {n} ({q!r}) retrieves no supporting passage in its top {topk}"
        found.add(hit.id)
        last = n == len(steps) and record.type == "compositional"
        hops.append(SourceHop(q, a, _final_aliases(a, record.answers) if last else (a,), Passage(hit.title, hit.text)))
        doc_ids.append(hit.id)
    if found != gold:
        return f"the sub-questions retrieve {len(found)} of the {len(gold)} supporting passages"
    return hops, doc_ids


class OpenAITeacher:
    """A chat call to any OpenAI-compatible endpoint (OpenAI, vLLM, this project's policy service), each reply
    cached on disk by its full request so a re-run of an import pays for nothing twice."""

    def __init__(self, base_url: str, model: str, cache_path: str | Path, api_key: str = "", timeout_s: float = 60.0,
                 max_retries: int = 3, max_tokens: int = 512):
        import openai

        self.client = openai.OpenAI(base_url=base_url or None, timeout=timeout_s, max_retries=max_retries,
                                    api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"))
        self.model, self.max_tokens = model, max_tokens
        self.cache_path = Path(cache_path)
        self.cache: dict[str, str] = {}
        self.calls = 0
        self._lock = threading.Lock()
        # a torn last line from an interrupted run is skipped: that reply is asked for again
        self.cache.update((row["key"], row["reply"]) for row in read_jsonl_journal(self.cache_path)
                          if "key" in row and "reply" in row)

    def __call__(self, messages: list[dict]) -> str:
        key = hashlib.sha256(json.dumps([self.model, self.max_tokens, messages], sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        resp = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0.0,
                                                   max_tokens=self.max_tokens)
        text = resp.choices[0].message.content or ""
        with self._lock:
            self.calls += 1
            self.cache[key] = text
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            # appended and synced: an interrupted import keeps its replies
            append_jsonl_synced(self.cache_path, {"key": key, "reply": text})
        return text


# ----------------------------------------------------------------------------- the import

@dataclass
class ImportConfig:
    dataset: str = cfg_field("musique", help="the dataset's schema", choices=DATASETS)
    align: AlignConfig = cfg_field(help="how supporting paragraphs are matched to corpus passages",
                                   factory=AlignConfig)
    teacher_topk: int = cfg_field(5, help="BM25 hits in which each teacher sub-question must find a gold "
                                          "supporting passage", min=1, max=100)
    teacher_max_steps: int = cfg_field(6, help="a teacher decomposition of more sub-questions is rejected",
                                       min=1, max=20)
    teacher_concurrency: int = cfg_field(8, help="teacher requests in flight at once", min=1, max=256)
    examples: int = cfg_field(10, help="unaligned hops and rejected teacher decompositions listed in the report",
                              min=0, max=10_000)


def _report_skeleton(cfg: ImportConfig) -> dict:
    return {"dataset": cfg.dataset, "records_read": 0, "skipped_unanswerable": 0, "questions_written": 0,
            "questions_with_decomposition": 0,
            "questions_without": {"unaligned_hop": 0, "no_decomposition": 0, "teacher_rejected": 0},
            "hops": 0, "hops_aligned_by_title": 0, "hops_aligned_by_text": 0, "hops_unaligned": 0,
            "hops_answer_in_passage": 0, "alignment_rate": 0.0,
            "supporting_passages": 0, "supporting_aligned": 0, "supporting_alignment_rate": 0.0,
            "teacher": None, "unaligned_examples": [], "teacher_rejections": []}


def import_records(records: Iterable[SourceRecord], titled: Mapping[str, Sequence[Document]], search: SearchFn,
                   cfg: ImportConfig | None = None, teacher: TeacherFn | None = None) -> tuple[list[dict], dict]:
    """(question rows, report). Every answerable record is written; only those whose every retrieval hop
    aligned carry a decomposition (``metadata.decomposition``), the others an empty one and, per hop, why
    (``metadata.alignment``). Records without a decomposition get one from ``teacher`` when given."""
    cfg = cfg or ImportConfig()
    rep = _report_skeleton(cfg)
    records = list(records)
    rep["records_read"] = len(records)
    kept = [r for r in records if r.answerable]
    rep["skipped_unanswerable"] = len(records) - len(kept)
    passages = [p for r in kept for p in r.supporting] + [h.support for r in kept for h in r.hops or () if h.support]
    aligned = align_passages(passages, titled, search, cfg.align)
    sup_all = [aligned[p] for r in kept for p in r.supporting]
    rep["supporting_passages"] = len(sup_all)
    rep["supporting_aligned"] = sum(bool(a.doc_id) for a in sup_all)
    if teacher is not None:
        rep["teacher"] = {"asked": 0, "kept": 0, "hops": 0, "failed_calls": 0, "unparsable": 0, "rejected": 0,
                          "skipped_unaligned_support": 0}
    replies = _teacher_replies(kept, aligned, teacher, cfg) if teacher is not None else {}
    rows = []
    for r in kept:
        hops, source, why = r.hops, "dataset", "no_decomposition"
        alignments = [aligned[h.support] if h.support else Alignment(reason="the record names no supporting paragraph")
                      for h in hops or ()]
        if hops is None and teacher is not None:
            hops, alignments, why = _check_teacher(r, replies.get(r.id), aligned, search, cfg, rep)
            source = "teacher"
        rows.append(_row(r, hops, alignments, source, why, aligned, rep, cfg))
    rep["questions_written"] = len(rows)
    aligned_hops = rep["hops_aligned_by_title"] + rep["hops_aligned_by_text"]
    rep["supporting_alignment_rate"] = round(rep["supporting_aligned"] / rep["supporting_passages"], 4) \
        if rep["supporting_passages"] else 0.0
    # a dataset without decompositions (HotpotQA) has no hops to align: its rate is its supporting passages'
    rep["alignment_rate_of"] = "hops" if rep["hops"] else "supporting_passages"
    rep["alignment_rate"] = round(aligned_hops / rep["hops"], 4) if rep["hops"] else rep["supporting_alignment_rate"]
    return rows, rep


def _teacher_ready(r: SourceRecord, aligned: Mapping[Passage, Alignment]) -> bool:
    """Whether a teacher's hops for ``r`` can be checked: it has no decomposition and all its support aligned."""
    return r.hops is None and bool(r.supporting) and all(aligned[p].doc_id for p in r.supporting)


def _teacher_replies(records: Sequence[SourceRecord], aligned: Mapping[Passage, Alignment], teacher: TeacherFn,
                     cfg: ImportConfig) -> dict[str, str | Exception]:
    """Record id -> the teacher's reply (or the call's error), asked ``teacher_concurrency`` at a time: an endpoint
    answers one request in seconds, and HotpotQA's train split has 90k questions."""
    def ask(r: SourceRecord) -> str | Exception:
        try:
            return teacher(teacher_messages(r.question, r.supporting))
        except Exception as e:  # noqa: BLE001 - one failed call costs one question, not the import
            log.warning("teacher call for %s failed: %s", r.id, e)
            return e

    asked = [r for r in records if _teacher_ready(r, aligned)]
    with ThreadPoolExecutor(cfg.teacher_concurrency) as pool:
        return dict(zip((r.id for r in asked), pool.map(ask, asked)))


def _check_teacher(r: SourceRecord, reply: str | Exception | None, aligned: Mapping[Passage, Alignment],
                   search: SearchFn, cfg: ImportConfig,
                   rep: dict) -> tuple[list[SourceHop] | None, list[Alignment], str]:
    """(hops, their alignments, why there are none): the teacher's decomposition of ``r``, checked."""
    t = rep["teacher"]
    if not _teacher_ready(r, aligned):
        t["skipped_unaligned_support"] += 1  # nothing to check its hops against: it was not asked
        return None, [], "no_decomposition"
    t["asked"] += 1
    if isinstance(reply, Exception) or reply is None:
        t["failed_calls"] += 1
        return None, [], "teacher_rejected"
    gold = [aligned[p].doc_id for p in r.supporting]
    try:
        steps, answer = parse_teacher_reply(reply, cfg.teacher_max_steps)
    except ValueError as e:
        t["unparsable"] += 1
        _example(rep, "teacher_rejections", cfg, {"id": r.id, "reason": f"unparsable reply: {e}"})
        return None, [], "teacher_rejected"
    checked = check_teacher_decomposition(r, steps, answer, gold, search, cfg.teacher_topk)
    if isinstance(checked, str):
        t["rejected"] += 1
        _example(rep, "teacher_rejections", cfg, {"id": r.id, "reason": checked})
        return None, [], "teacher_rejected"
    t["kept"] += 1
    hops, doc_ids = checked
    t["hops"] += len(hops)
    return hops, [Alignment(d, "retrieved", title=h.support.title, text=h.support.text)
                  for h, d in zip(hops, doc_ids)], ""


def _example(rep: dict, key: str, cfg: ImportConfig, item: dict) -> None:
    if len(rep[key]) < cfg.examples:
        rep[key].append(item)


def _row(r: SourceRecord, hops: Sequence[SourceHop] | None, alignments: Sequence[Alignment], source: str, why: str,
         aligned: Mapping[Passage, Alignment], rep: dict, cfg: ImportConfig) -> dict:
    supporting_ids = list(dict.fromkeys(aligned[p].doc_id for p in r.supporting if aligned[p].doc_id))
    meta: dict[str, Any] = {"source": r.dataset, "source_type": r.source_type, "type": r.type,
                            "hops": len(hops) if hops else len(r.supporting) or 1, "decomposition": [],
                            "supporting_doc_ids": supporting_ids}
    if hops is None:
        rep["questions_without"][why] += 1
        return {"id": r.id, "question": r.question, "golden_answers": list(r.answers), "metadata": meta}
    steps, full = [], True
    for n, (h, a) in enumerate(zip(hops, alignments)):
        if source == "dataset":  # a teacher's hops are not the dataset's: counted in the teacher's report
            rep["hops"] += 1
            if a.by:
                rep[f"hops_aligned_by_{a.by}"] += 1
            else:
                rep["hops_unaligned"] += 1
                _example(rep, "unaligned_examples", cfg, {"id": r.id, "hop": n + 1, "title": h.support.title
                                                          if h.support else "", "reason": a.reason})
            if a.doc_id and _words(h.answer) and normalize_answer(h.answer) in normalize_answer(a.text):
                rep["hops_answer_in_passage"] += 1  # how often the aligned passage states the sub-answer
        full = full and bool(a.doc_id)
        # title: the corpus passage's (what the retriever shows); the dataset's own is kept beside it
        steps.append({"question": h.question, "answer": h.answer, "answer_aliases": list(h.answer_aliases),
                      "doc_id": a.doc_id, "title": a.title, "aligned_by": a.by,
                      "source_title": h.support.title if h.support else "",
                      **({"reason": a.reason} if a.reason else {})})
    meta["alignment"] = steps
    meta["decomposition_source"] = source
    if full and steps:
        decomposition = [{k: v for k, v in s.items() if k not in ("aligned_by", "source_title", "reason")}
                         for s in steps]
        if r.type != "compositional":  # the final comparison: a reasoning step needing no retrieval
            decomposition.append({"question": r.question, "answer": r.answers[0], "answer_aliases": list(r.answers),
                                  "doc_id": "", "title": ""})
        meta["decomposition"] = decomposition
        rep["questions_with_decomposition"] += 1
    else:
        rep["questions_without"]["unaligned_hop"] += 1
    return {"id": r.id, "question": r.question, "golden_answers": list(r.answers), "metadata": meta}


def format_report(rep: dict) -> str:
    """One human line per dataset: what aligned and how many questions SFT can train on."""
    line = f"{rep['dataset']}: {rep['records_read']} records, {rep['questions_written']} questions written; "
    if rep["alignment_rate_of"] == "hops":
        line += (f"{rep['hops']} hops, {rep['hops_aligned_by_title']} aligned by title, {rep['hops_aligned_by_text']} "
                 f"by BM25 text, {rep['hops_unaligned']} not: alignment rate {rep['alignment_rate']:.1%}; ")
    else:
        line += f"no decomposition in the dataset: alignment rate {rep['alignment_rate']:.1%} of supporting passages; "
    line += (f"supporting passages {rep['supporting_aligned']}/{rep['supporting_passages']} aligned; "
             f"{rep['questions_with_decomposition']} questions with a full decomposition (SFT's agent mode trains "
             "on these)")
    if rep["skipped_unanswerable"]:
        line += f"; {rep['skipped_unanswerable']} unanswerable skipped"
    t = rep.get("teacher")
    if t:
        line += (f"; teacher: {t['asked']} asked, {t['kept']} kept, {t['rejected']} rejected, {t['unparsable']} "
                 f"unparsable, {t['failed_calls']} failed calls")
    return line

