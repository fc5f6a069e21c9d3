"""Pre-training data for the embedded base policy: a copy task and a reading curriculum.

Why: the paper starts from Qwen3-8B, a base model that already copies names from its context and
answers questions about a passage. The embedded stand-in is trained from random init on 2 CPU
cores, and measured there (docs/BENCHMARKS.md) it never learnt to read from the SFT data alone in
the 20-minute budget: one answer token per ~600-token trajectory is too sparse a signal. Short
phases give it those abilities first, for the policy and both baselines alike:

1. copy: random token strings shown twice, loss on the repeat. With the default single length the
   model learns to attend a fixed distance back, not content-based copying (induction), which from
   random init only formed after ~1,250 steps of varied-length strings (docs/BENCHMARKS.md). Options:
   lengths drawn per batch, copy rows kept in every later step, and the ``cpu-induction`` preset,
   which starts with an induction circuit wired in (prorag.init_circuits);
2. reading: a passage then "Question: ...\\nAnswer: ..." lines about it, the passage growing from the
   one sentence that holds the answer to the whole document with several questions;
3. optional, off by default: reading among retrieved documents, the fact's document and distractors
   rendered as retrieval results ("Doc i(Title: ...) ..."), then the questions (some rows as a
   chat turn). Tried because a base that read single documents at 72-84% still fell back to the
   answer prior ("yes"/"no") once fine-tuned on three retrieved documents per question; measured,
   it did not prevent that (docs/BENCHMARKS.md).
4. optional, off by default: the gap phase. What the fallback actually came from (measured): the base
   read only when "Answer:" came right after the question (65%); one sentence between gave 18%, a
   stage's tags and thought 5%. Gap rows put filler there, or the question before the passage as an
   agent's subquery precedes its documents; counterfactual rows swap the answers so they can only be
   read, not recalled.
5. optional, off by default: paraphrase rows (another phrasing of a train question, its name copied
   in, as a subquery restates the question) mixed with gap rows.

Pure functions (no I/O): facts come from the train split's gold decompositions, passages from the corpus.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from prorag.data.loaders import parse_contents
from prorag.trajectory import IM_END, IM_START, render_docs

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Fact:
    """One single-hop fact: a question about document doc_id and its answer (found in the text)."""

    doc_id: str
    question: str
    answer: str


def facts_from_questions(questions) -> list[Fact]:
    """Distinct (doc, question, answer) hops of gold decompositions, in first-seen order."""
    seen, out = set(), []
    for q in questions:
        for s in q.decomposition:
            key = (s.doc_id, s.question)
            if s.doc_id and s.answer and key not in seen:
                seen.add(key)
                out.append(Fact(s.doc_id, s.question, s.answer))
    return out


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def copy_batch(rng: random.Random, batch: int, length: int, low: int, high: int) -> list[list[int]]:
    """[batch][2*length] token ids: a random string of ``length`` ids in [low, high) written twice."""
    out = []
    for _ in range(batch):
        half = [rng.randrange(low, high) for _ in range(length)]
        out.append(half + half)
    return out


def reading_example(rng: random.Random, text: str, facts: Sequence[Fact], n_sentences: int | None,
                    max_questions: int = 6, question_first: bool = False,
                    gap: str = "") -> list[tuple[str, bool]] | None:
    """A passage and question/answer lines as (segment, trained) pairs; the answers are the trained parts.

    n_sentences: the passage is the sentence holding one fact's answer plus n-1 other sentences of the
    document, shuffled (one question); None: the whole document and up to max_questions questions.
    question_first: one question, asked before the passage (as an agent's subquery precedes its
    retrieved documents). gap: text between each question and its "Answer:" (every stage's format puts
    tags and a thought there; a base trained without a gap read at 65% with the answer right after the
    question and at 18% with one sentence between, measured).
    Returns None when no sentence contains the answer.
    """
    if n_sentences is None:
        chosen = list(facts)
        rng.shuffle(chosen)
        chosen = chosen[:max_questions]
        passage = text.strip()
    else:
        fact = rng.choice(list(facts))
        sents = sentences(text)
        holding = [s for s in sents if fact.answer in s]
        if not holding:
            return None
        rest = [s for s in sents if s not in holding]
        rng.shuffle(rest)
        picked = [holding[0]] + rest[:max(0, n_sentences - 1)]
        rng.shuffle(picked)
        passage = " ".join(picked)
        chosen = [fact]
    if question_first:
        f = chosen[0]
        return [(f"Question: {f.question}\n{passage}\n{gap}Answer:", False), (f" {f.answer}", True), ("\n", False)]
    segs: list[tuple[str, bool]] = [(passage + "\n", False)]
    for f in chosen:
        segs.append((f"Question: {f.question}\n{gap}Answer:", False))
        segs.append((f" {f.answer}", True))
        segs.append(("\n", False))
    return segs


#: system prompt of the chat-form reading rows: generic, unlike any stage's prompt
READING_SYSTEM_PROMPT = "Answer the question from the documents."


def retrieved_reading_example(rng: random.Random, doc_id: str, docs: Mapping[str, str], facts: Sequence[Fact],
                              distractors: Sequence[str], max_questions: int = 3,
                              chat: bool = False) -> list[tuple[str, bool]]:
    """Documents rendered as retrieval results (``doc_id``'s and ``distractors``, shuffled), then up to
    max_questions questions about ``doc_id``'s facts, as (segment, trained) pairs.

    chat: one question as a chat turn (system, user: documents + question, assistant: the answer and
    <|im_end|>), the layout every stage's prompt uses, as an instruction-tuned base has seen it.
    docs: doc id -> wiki-18 ``contents`` (quoted title line, then text).
    """
    ids = [doc_id, *distractors]
    rng.shuffle(ids)
    rendered = render_docs([parse_contents(docs[i]) for i in ids])
    chosen = list(facts)
    rng.shuffle(chosen)
    if chat:
        f = chosen[0]
        return [(f"{IM_START}system\n{READING_SYSTEM_PROMPT}{IM_END}\n{IM_START}user\nDocuments:\n{rendered}\n\n"
                 f"Question: {f.question}{IM_END}\n{IM_START}assistant\n", False), (f"{f.answer}{IM_END}", True)]
    segs: list[tuple[str, bool]] = [(rendered + "\n", False)]
    for f in chosen[:max_questions]:
        segs.append((f"Question: {f.question}\nAnswer:", False))
        segs.append((f" {f.answer}", True))
        segs.append(("\n", False))
    return segs


def relation_key(question: str, title: str) -> str:
    """A fact's relation: its question with the subject's title replaced by X ("Who founded X?")."""
    return question.replace(title, "X") if title else question


def answer_pools(facts: Sequence[Fact], docs: Mapping[str, str]) -> dict[str, list[str]]:
    """relation key -> the distinct answers of that relation, sorted (what a swap draws from)."""
    pools: dict[str, set[str]] = {}
    for f in facts:
        if f.doc_id in docs:
            pools.setdefault(relation_key(f.question, parse_contents(docs[f.doc_id])[0]), set()).add(f.answer)
    return {k: sorted(v) for k, v in pools.items()}


def counterfactual_swap(rng: random.Random, text: str, facts: Sequence[Fact], title: str,
                        pools: Mapping[str, Sequence[str]]) -> tuple[str, list[Fact]]:
    """The document with each fact's answer replaced, in the text and in the fact, by another answer of
    the same relation (a city by a city, a year by a year); one substitute per answer string.

    Why: 89% of the test split's hop facts are also train facts, so recall can pass for reading; a
    swapped fact can only be answered from the passage. Measured, the default base read swapped passages
    at 73% (true ones 77%), so it does read, and a warm-up on swapped passages only read worse (60%):
    an option, off by default. Answers absent from the text stay as they are.
    """
    subs: dict[str, str] = {}
    for f in facts:
        if f.answer in subs or not re.search(rf"\b{re.escape(f.answer)}\b", text):
            continue
        pool = [a for a in pools.get(relation_key(f.question, title), ()) if a != f.answer and a not in subs.values()]
        if pool:
            subs[f.answer] = pool[rng.randrange(len(pool))]
    if not subs:
        return text, list(facts)
    # one pass over all answers, longest first, so a substitute is never itself replaced
    pattern = re.compile(r"\b(" + "|".join(re.escape(a) for a in sorted(subs, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: subs[m.group(1)], text), [Fact(f.doc_id, f.question, subs.get(f.answer, f.answer))
                                                           for f in facts]


def paraphrase_groups(facts: Sequence[Fact]) -> list[list[str]]:
    """The phrasings of each fact asked more than one way (same document and answer), in first-seen order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in facts:
        phrasings = groups.setdefault((f.doc_id, f.answer), [])
        if f.question not in phrasings:
            phrasings.append(f.question)
    return [g for g in groups.values() if len(g) > 1]


def paraphrase_example(rng: random.Random, phrasings: Sequence[str]) -> list[tuple[str, bool]]:
    """One phrasing of a fact asked, another one trained ("Question: ...\nIn other words: ...").

    Why: a subquery restates part of the question with its name copied in ("... who established Mai
    Brewery ..." -> "Who founded Mai Brewery?"). The HF-init base put that name into 2% of its subqueries,
    22% after 150 steps of these rows (teacher-forced, docs/BENCHMARKS.md).
    """
    asked, restated = rng.sample(list(phrasings), 2)
    return [(f"Question: {asked}\nIn other words: ", False), (restated, True), ("\n", False)]


def facts_by_doc(facts: Sequence[Fact], docs: Mapping[str, str]) -> dict[str, list[Fact]]:
    """Facts grouped by document, keeping only documents present in ``docs``."""
    out: dict[str, list[Fact]] = {}
    for f in facts:
        if f.doc_id in docs:
            out.setdefault(f.doc_id, []).append(f)
    return out


__all__ = ["READING_SYSTEM_PROMPT", "Fact", "facts_from_questions", "sentences", "copy_batch", "reading_example",
           "retrieved_reading_example", "facts_by_doc", "relation_key", "answer_pools", "counterfactual_swap",
           "paraphrase_groups", "paraphrase_example"]
