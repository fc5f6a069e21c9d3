"""Agentic rollouts with live retrieval: pure orchestration over an engine and a search function.

All questions x n samples advance together in rounds. Each round makes one ``engine.generate``
call for every unfinished trajectory and ``search_fn`` calls of at most ``search_batch`` of the
round's subqueries each (a retriever refuses a request over its max_batch). Token ids are carried,
never re-encoded: generated ids are appended as the engine returned them (mask 1, with their
log-probs and format-aware loss weights) and the environment's glue and documents are tokenised on
their own and appended (mask 0, log-prob 0), each step's span recorded in the trajectory's
:class:`~prorag.tokens.TokenTrajectory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from prorag.data.loaders import Document
from prorag.errors import InvalidArgument
from prorag.tokens import TokenTrajectory
from prorag.trajectory import (
    FINAL, FORMAT_LOSS_WEIGHTS, NEXT_STEP, STOP_TAGS, TAGS, Step, clean_doc, format_loss_weights, is_valid_format,
    parse_step, render_prompt, retrieval_block,
)

from prorag.engine import GenerationEngine, SamplingSpec, derive_seed

SearchFn = Callable[[list[str], int], list[list[Document]]]
#: queries per search_fn call when neither the caller nor the search function says: half the
#: retriever's default max_batch (512), as RetrieverClient.get_documents chunks
DEFAULT_SEARCH_BATCH = 256
FINISH_REASONS = ("answer", "max_steps", "length", "invalid_format")


@dataclass
class TrajectoryResult:
    """One finished trajectory.

    tokens: the whole sequence, prompt included, with one span per step (``tokens.spans[i]`` is
      ``steps[i]``'s tokens).
    finish_reason: "answer" | "max_steps" | "length" | "invalid_format".
    text: the decoded trajectory after the prompt (generated pieces and glue, as appended).
    """

    question_id: str
    sample_index: int
    question: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    format_valid: bool = False
    finish_reason: str = ""
    tokens: TokenTrajectory = field(default_factory=TokenTrajectory)
    adapter: str | None = None
    text: str = ""
    rounds: int = 0


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Ids to text exactly: special tokens kept, no clean-up of spaces."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def format_stop_ids(tokenizer) -> tuple[int, ...]:
    """Token ids of the format's stop tags; each must be a single token of ``tokenizer``."""
    ids = []
    for tag in STOP_TAGS:
        enc = tokenizer.encode(tag, add_special_tokens=False)
        if len(enc) != 1:
            raise InvalidArgument(f"stop tag {tag!r} is not a single token of this tokenizer ({enc})")
        ids.append(enc[0])
    return tuple(ids)


def _tag_ids(tokenizer) -> dict[str, int]:
    """tag -> token id, for the format tags that are one token of ``tokenizer`` (all of them for a policy's)."""
    encoded = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in TAGS}
    return {tag: ids[0] for tag, ids in encoded.items() if len(ids) == 1}


def run_rollouts(engine: GenerationEngine, tokenizer, questions: Sequence[tuple[str, str]], params: SamplingSpec,
                 search_fn: SearchFn, max_steps: int = 13, topk: int = 3, adapter: str | None = None,
                 on_finished: Callable[[TrajectoryResult], None] | None = None,
                 max_model_len: int | None = None,
                 loss_weights: Mapping[str, float] = FORMAT_LOSS_WEIGHTS,
                 search_batch: int | None = None, search_cache: bool = True,
                 stats: dict | None = None, question_offset: int = 0) -> list[TrajectoryResult]:
    """Run ``params.n`` trajectories per (id, question); returns them question-major, sample-minor.

    params: n = samples per question; max_tokens caps one step; stop ids are the format's own.
    loss_weights: tag -> weight given to generated tokens in ``tokens.weights`` (as
    :func:`prorag.data.sft.encode_segments` does), so a trainer can fine-tune on rollouts directly.
    Seeds: trajectory (q, j) at round r samples with ``derive_seed(params.seed, question_offset + q, j, r)``
    (unseeded when params.seed is 0), so a seeded run does not depend on batching, and a request split into parts
    (each with its first question's place as ``question_offset``) samples what the whole request would.
    ``on_finished`` is called as each trajectory ends, before the next round.
    search_batch: most subqueries per ``search_fn`` call; default: ``search_fn.max_batch`` when the
    search function carries one (e.g. learnt from the retriever's ListIndexes), else
    ``DEFAULT_SEARCH_BATCH``. A round with more subqueries makes several calls, in order.
    search_cache: each distinct subquery is searched once per call: a group's samples mostly ask their
    question's same subqueries, in the same round or later ones (retrieval is deterministic per query, so the
    trajectories are the same either way). ``stats``, when given, gains ``searches_asked`` and
    ``searches_made`` (their ratio is the cache's miss rate).
    Every round either ends a trajectory or adds a step, so at most ``max_steps`` rounds run.
    """
    params.validate()
    if max_steps < 1:
        raise InvalidArgument(f"max_steps must be >= 1, got {max_steps}")
    if topk < 1:
        raise InvalidArgument(f"topk must be >= 1, got {topk}")
    if question_offset < 0:
        raise InvalidArgument(f"question_offset must be >= 0, got {question_offset}")
    search_batch = int(search_batch or getattr(search_fn, "max_batch", 0) or DEFAULT_SEARCH_BATCH)
    if search_batch < 1:
        raise InvalidArgument(f"search_batch must be >= 1, got {search_batch}")
    limit = int(max_model_len or getattr(engine, "max_model_len", 0) or 0)
    if limit <= 0:
        raise InvalidArgument("the engine reports no max_model_len; pass max_model_len")
    stop_ids = format_stop_ids(tokenizer)
    final_ids = tokenizer.encode(FINAL, add_special_tokens=False)
    next_step_ids = tokenizer.encode(NEXT_STEP, add_special_tokens=False)
    tag_ids = _tag_ids(tokenizer)
    step_spec = SamplingSpec(n=1, temperature=params.temperature, top_p=params.top_p,
                             max_tokens=params.max_tokens, stop_token_ids=stop_ids, seed=params.seed,
                             tempered_logprobs=params.tempered_logprobs)

    results: list[TrajectoryResult] = []
    texts: list[list[str]] = []
    for qi, (qid, question) in enumerate(questions):
        if not isinstance(question, str) or not question.strip():
            raise InvalidArgument(f"question {qid!r} is empty")
        prompt_ids = tokenizer.encode(render_prompt(question), add_special_tokens=False)
        for j in range(params.n):
            results.append(TrajectoryResult(question_id=str(qid), sample_index=j, question=question,
                                            tokens=TokenTrajectory.from_prompt(prompt_ids), adapter=adapter))
            texts.append([])

    def finish(k: int, reason: str) -> None:
        r = results[k]
        r.finish_reason = reason
        r.format_valid = reason == "answer" and is_valid_format(r.steps)
        r.answer = r.steps[-1].content if r.steps and r.steps[-1].kind == "answer" else None
        r.text = "".join(texts[k])
        if on_finished is not None:
            on_finished(r)

    def append_glue(k: int, ids: list[int], text: str) -> bool:
        # inserted text that would overflow the context ends the trajectory instead
        if len(results[k].tokens) + len(ids) > limit:
            return False
        results[k].tokens.add_inserted(ids)
        texts[k].append(text)
        return True

    active = []
    for k, r in enumerate(results):
        if len(r.tokens) >= limit:
            finish(k, "length")
        else:
            active.append(k)

    searched: dict[str, list] = {}  # subquery -> its documents, for this call (search_cache)
    counts = stats if stats is not None else {}
    counts.setdefault("searches_asked", 0)
    counts.setdefault("searches_made", 0)
    rnd = 0
    while active:
        seeds = [derive_seed(params.seed, question_offset + k // params.n, results[k].sample_index, rnd)
                 for k in active]
        outs = engine.generate([results[k].tokens.token_ids for k in active], step_spec, adapter=adapter, seeds=seeds)
        rnd += 1
        searches: list[int] = []
        still: list[int] = []
        for k, seqs in zip(active, outs):
            r, seq = results[k], seqs[0]
            r.rounds = rnd
            room = limit - len(r.tokens)
            gen_ids, gen_lps = list(seq.token_ids), list(seq.logprobs)
            if len(gen_ids) > room:
                # only when max_model_len is below the engine's own limit: cut the step to fit
                gen_ids, gen_lps = gen_ids[:room], gen_lps[:room]
            r.tokens.add_step(gen_ids, format_loss_weights(gen_ids, tag_ids, loss_weights), gen_lps)
            gen_text = decode(tokenizer, gen_ids)
            texts[k].append(gen_text)
            step = parse_step(gen_text)
            r.steps.append(step)
            if step.kind == "answer":
                if not append_glue(k, final_ids, FINAL):
                    finish(k, "length")
                    continue
                finish(k, "answer")
            elif step.kind == "invalid":
                # a step cut by the context limit is a length stop, not a format error
                hit_limit = len(r.tokens) >= limit and (seq.finish_reason == "length"
                                                        or len(gen_ids) < len(seq.token_ids))
                finish(k, "length" if hit_limit else "invalid_format")
            elif step.kind == "subquery":
                searches.append(k)
            else:  # subanswer
                if not append_glue(k, next_step_ids, NEXT_STEP):
                    finish(k, "length")
                elif len(r.steps) >= max_steps:
                    finish(k, "max_steps")
                else:
                    still.append(k)
        if searches:
            queries = [results[k].steps[-1].content for k in searches]
            missing = list(dict.fromkeys(q for q in queries if q not in searched)) if search_cache else queries
            got_all: list = []
            for i in range(0, len(missing), search_batch):
                chunk = missing[i:i + search_batch]
                got = list(search_fn(chunk, topk))
                if len(got) != len(chunk):
                    raise InvalidArgument(f"search_fn returned {len(got)} results for {len(chunk)} queries")
                got_all += got
            if search_cache:
                searched.update(zip(missing, got_all))
                found = [searched[q] for q in queries]
            else:
                found = got_all
            counts["searches_asked"] += len(queries)
            counts["searches_made"] += len(missing)
            for k, docs in zip(searches, found):
                step = results[k].steps[-1]
                docs = [clean_doc(d) for d in list(docs)[:topk]]
                block = retrieval_block(docs)
                if not append_glue(k, tokenizer.encode(block, add_special_tokens=False), block):
                    finish(k, "length")
                    continue
                step.docs = docs
                if len(results[k].steps) >= max_steps:
                    finish(k, "max_steps")
                else:
                    still.append(k)
        # keep the input order among survivors so batches stay stable across rounds
        still.sort()
        active = []
        for k in still:
            if len(results[k].tokens) >= limit:
                finish(k, "length")
            else:
                active.append(k)
    return results


def summarize(results: Sequence[TrajectoryResult]) -> dict:
    """Counts for logs: finish reasons, valid-format rate, tokens."""
    reasons = {r: 0 for r in FINISH_REASONS}
    for t in results:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    n = max(len(results), 1)
    return {"trajectories": len(results), "finish_reasons": reasons,
            "format_valid_rate": sum(t.format_valid for t in results) / n,
            "generated_tokens": sum(t.tokens.generated_tokens for t in results),
            "mean_steps": sum(len(t.steps) for t in results) / n}


__all__ = ["TrajectoryResult", "SearchFn", "DEFAULT_SEARCH_BATCH", "FINISH_REASONS", "run_rollouts", "format_stop_ids",
           "decode", "summarize"]
