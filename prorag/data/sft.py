"""Training samples for SFT warm-up and its baselines, built from gold decompositions.

Pure functions (no I/O): the caller supplies retrieved documents and a thought writer.

- ``agent``: ProRAG's step-by-step trajectory (subquery -> retrieval -> subanswer per hop,
  then the answer), the documents being what the retriever returns for the gold sub-question
  (with the supporting document guaranteed among them so every subanswer is grounded).
- ``no_retrieval``: question -> answer step.
- ``standard_rag``: the question's top-k documents + question -> answer step.

ProRAG builds one training sample per step (the prefix up to that step as context). Packing a
trajectory's steps into one sequence, with the loss only on generated tokens, gives every step
the same context and gradient at a fraction of the compute, so samples here are whole
trajectories; the per-token weights implement the format-aware loss.
"""

from __future__ import annotations

import random
from typing import Callable, Mapping, Sequence

from prorag.data.loaders import Document, Question
from prorag.tokens import TokenTrajectory
from prorag.trajectory import (SYSTEM_PROMPT, Step, format_loss_weights, glue_after, render_docs, render_prompt,
                               FORMAT_LOSS_WEIGHTS)

BASELINE_SYSTEM_PROMPT = (
    "Answer the question. Write a short thought, close it with </step>, then give the final short answer "
    "inside <answer>\n...</answer>."
)

# Offline thoughts: short first-person templates, chosen per question by a seeded rng (an LLM
# rewrites them when an OpenAI-compatible endpoint is configured).
_SEARCH = ("I need to look this up.", "Next I should search.", "Let me search for this.", "I must find this first.")
_READ = ("The documents answer this.", "I found it in the documents.", "The search results say it.")
_FINAL = ("Now I can answer the question.", "I have everything I need.", "That resolves the question.")
_COMPARE = ("Comparing the facts I found answers the question.", "Putting the two facts side by side gives the answer.")
_DIRECT = ("I will answer from what I know.", "Let me answer directly.")
_GROUNDED = ("The documents contain what I need.", "I can answer from the documents.")

ThoughtFn = Callable[[str, str, dict], str]


def template_phrases() -> list[str]:
    """Every offline thought (the tokenizer is trained on them so they encode short)."""
    return [*_SEARCH, *_READ, *_FINAL, *_COMPARE, *_DIRECT, *_GROUNDED]


def template_thought(kind: str, question_id: str, ctx: dict) -> str:
    """Deterministic offline thought for a step. kind: search|read|final|compare|direct|grounded."""
    table = {"search": _SEARCH, "read": _READ, "final": _FINAL, "compare": _COMPARE, "direct": _DIRECT,
             "grounded": _GROUNDED}[kind]
    rng = random.Random(f"{question_id}/{kind}/{ctx.get('hop', 0)}")
    return rng.choice(table).format(**ctx)


def restated(thought: str, question: str) -> str:
    """A thought that ends by restating the question the next answer answers.

    Why: the small embedded bases read an answer out of a passage only when the question sits right
    before it (docs/BENCHMARKS.md, "Reading behind the format"); in the step format the subquery is
    a whole retrieval block away from its subanswer. LLM-written thoughts (ProRAG's GPT-4o rewrites)
    usually name what was found; this makes the template ones do it too.
    """
    return f"{thought} {question}" if question else thought


_COUNT = ("No searches", "One search", "Two searches", "Three searches", "Four searches", "Five searches",
          "Six searches")


def plan_note(remaining: int, compare: bool) -> str:
    """The plan a thought carries: searches still to do, and whether a comparison follows them.

    Why: a 3M-parameter policy that must recount a question's hops after every subanswer stops
    after the first one (docs/BENCHMARKS.md); LLM-written thoughts say what is left, so whether to
    search again is read off the thought just written. The count is written as a word so the
    tokenizer's existing vocabulary covers it.
    """
    count = _COUNT[remaining] if remaining < len(_COUNT) else f"{remaining} searches"
    return f"{count} to go{', then compare' if compare else ''}."


def single_search_thoughts(question_id: str, question: str, thought: ThoughtFn = template_thought,
                           restate: bool = False, plan: bool = False) -> tuple[str, str, str]:
    """(search, read, final) thoughts of the agent's trajectory for a 1-hop question whose one sub-question is
    ``question`` itself, exactly as :func:`agent_steps` writes them: what an evaluation that holds the agent
    to one search made with the question (standard RAG read by the agent) writes around the model's reading."""
    ctx = {"q": question, "hop": 0}
    search = thought("search", question_id, ctx)
    read = thought("read", question_id, ctx)
    final = thought("final", question_id, {"hop": 1})
    if plan:
        search, final = f"{plan_note(1, False)} {search}", f"{plan_note(0, False)} {final}"
    return search, restated(read, question) if restate else read, final


def ensure_gold(docs: Sequence[Document], gold: Document, topk: int) -> list[Document]:
    """The retrieved top-k with the gold document present (replacing the last one if it was missed)."""
    docs = list(docs[:topk])
    if any(d.id == gold.id for d in docs if gold.id):
        return docs
    return (docs[:topk - 1] + [gold]) if docs else [gold]


def agent_steps(question, retrieved: Mapping[str, Sequence[Document]], gold_docs: Mapping[str, Document],
                topk: int = 3, thought: ThoughtFn = template_thought, restate: bool = False,
                plan: bool = False, phrasing: Callable[[str], str] | None = None) -> list[Step]:
    """Gold step-by-step trajectory for a Question with a decomposition.

    retrieved: subquery -> retriever results; gold_docs: doc id -> the supporting document.
    phrasing: how a gold sub-question is written as the subquery (None = verbatim), e.g.
    :func:`prorag.data.world.canonical_question`; ``retrieved`` is keyed by the written subquery.
    restate: each subanswer's thought ends with its subquery, a comparison's final thought with the
    question (:func:`restated`); a compositional final answer repeats the last subanswer, so its
    thought is left alone.
    plan: every subquery's thought and the answer's begin with :func:`plan_note` (searches left,
    and "then compare" for comparisons), counting down to "No searches to go."
    """
    steps: list[Step] = []
    hops = [s for s in question.decomposition if s.doc_id]
    final_kind = "final" if question.qtype == "compositional" else "compare"

    def planned(text: str, remaining: int) -> str:
        return f"{plan_note(remaining, final_kind == 'compare')} {text}" if plan else text

    for i, sub in enumerate(hops):
        subquery = phrasing(sub.question) if phrasing else sub.question
        docs = ensure_gold(retrieved.get(subquery, []), gold_docs[sub.doc_id], topk)
        ctx = {"q": subquery, "hop": i}
        steps.append(Step("subquery", thought=planned(thought("search", question.id, ctx), len(hops) - i),
                          content=subquery, docs=docs))
        read = thought("read", question.id, ctx)
        steps.append(Step("subanswer", thought=restated(read, subquery) if restate else read, content=sub.answer))
    final = planned(thought(final_kind, question.id, {"hop": len(hops)}), 0)
    if restate and final_kind == "compare":
        final = restated(final, question.question)
    steps.append(Step("answer", thought=final, content=question.golden_answers[0]))
    return steps


def baseline_prompt(question: str, docs: Sequence[Document] | None = None) -> str:
    """Prompt of the no-retrieval (docs None) and standard-RAG baselines, in the same chat layout."""
    user = question if docs is None else f"Documents:\n{render_docs(docs)}\n\nQuestion: {question}"
    return render_prompt(user, BASELINE_SYSTEM_PROMPT)


def baseline_steps(question, grounded: bool, thought: ThoughtFn = template_thought,
                   restate: bool = False) -> list[Step]:
    """The baselines' one answer step; restate: its thought ends with the question (:func:`restated`)."""
    text = thought("grounded" if grounded else "direct", question.id, {})
    return [Step("answer", thought=restated(text, question.question) if restate else text,
                 content=question.golden_answers[0])]


def hop_questions(question) -> list:
    """One single-hop question per retrieval hop of ``question``'s gold decomposition: its sub-question,
    answered by its sub-answer (and aliases). The per-hop reading samples a baseline trains on besides whole
    questions, so it learns to read an answer out of retrieved documents as the agent's subanswers do."""
    return [Question(id=f"{question.id}/hop{i}", question=s.question,
                     golden_answers=[s.answer, *[a for a in s.answer_aliases if a != s.answer]],
                     metadata={"type": "compositional", "hops": 1,
                               "decomposition": [{"question": s.question, "answer": s.answer, "doc_id": s.doc_id,
                                                  "title": s.title}]})
            for i, s in enumerate(x for x in question.decomposition if x.doc_id)]


def encode_segments(tokenizer, prompt: str, steps: Sequence[Step], tag_ids: Mapping[str, int],
                    loss_weights: Mapping[str, float] = FORMAT_LOSS_WEIGHTS) -> TokenTrajectory:
    """Tokenise segment by segment exactly as a rollout appends them (prompt, step, glue, step...),
    so training sees the same ids the policy produces at inference, with one span per step.

    tag_ids: tag -> its token id; loss_weights: tag -> CE weight of the format-aware loss ({} = plain
    loss, every generated token weighing 1). Log-probs are unknown (0.0).
    """
    out = TokenTrajectory.from_prompt(tokenizer.encode(prompt, add_special_tokens=False))
    for step in steps:
        gen = tokenizer.encode(step.text, add_special_tokens=False)
        out.add_step(gen, format_loss_weights(gen, tag_ids, loss_weights))
        glue = glue_after(step)
        if glue:
            out.add_inserted(tokenizer.encode(glue, add_special_tokens=False))
    return out


def content_prefix_ids(tokenizer, prompt: str, steps: Sequence[Step]) -> list[int]:
    """Token ids of ``prompt`` + ``steps`` up to where the last step's content begins, tokenised as
    :func:`encode_segments` tokenises a training sample: what a caller sends a policy so that it writes that
    content (its reading) after exactly the ids it was trained on. (A text prefix would be tokenised whole, and
    a step cut before its content tokenises differently from the same step whole: the space a word carries.)

    The cut is where two encodings that differ only in the last step's content part."""
    last = steps[-1]
    ids = [encode_segments(tokenizer, prompt, [*steps[:-1], Step(last.kind, thought=last.thought, content=c,
                                                                docs=last.docs)], {}, {}).token_ids
           for c in ("a", "b")]
    n = 0
    while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
        n += 1
    return ids[0][:n]


def agent_prompt(question: str) -> str:
    return render_prompt(question, SYSTEM_PROMPT)


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int, group: int = 16) -> list[list[int]]:
    """One epoch's batches of sample indices, each batch of similar lengths; a function of the seed only.

    lengths [N] -> ceil(N / batch_size) batches covering every index once. The epoch is shuffled,
    cut into windows of ``group`` batches, each window sorted by length and cut into batches, and
    the batch order shuffled again. Why: agent trajectories run from ~200 to ~1,000 tokens, and
    random batches of 8 spent about a third of each step on padding (measured 63% of tokens real).
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = max(1, batch_size * group)
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
