"""The MCTS environment through the services: what :func:`prorag.search.mcts.search` calls to sample steps, roll out
and score, with the policy service generating and the retriever service searching (through a cache shared by
every question of a run, since siblings and rollouts repeat subqueries).

Token ids are carried as in :mod:`prorag.rollout`: each generated step keeps the ids the policy returned, and
the environment's glue (retrieval block, next-step opener, end of turn) is tokenised on its own, so a prefix
sent back to the policy is exactly the sequence the policy produced.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from prorag import paths
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.io import append_jsonl_synced, read_jsonl_journal
from prorag.rollout import decode
from prorag.rpc.clients import PolicyClient, RetrieverClient, call_with_service_wait
from prorag.data.loaders import Document, load_split
from prorag.data.world.config import TEST_SPLITS
from prorag.metrics import f1_score
from prorag.trajectory import Step, clean_doc, glue_after, parse_step, render_prompt, render_step, retrieval_block


class CachedSearch:
    """Retrieval through a RetrieverClient with a run-wide cache keyed by (query, topk, index); thread-safe.

    Concurrent misses on the same key may both search; the result is the same, so it is only counted twice."""

    def __init__(self, client, topk: int, index: str = "", service_wait_s: float = 0.0,
                 stats: dict | None = None):
        self.client, self.topk, self.index = client, topk, index
        # a retriever that goes away (UNAVAILABLE) is waited for this long, in all per search, and asked again
        self.service_wait_s, self.stats = service_wait_s, stats if stats is not None else {}
        self._cache: dict[tuple[str, int, str], list[Document]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, query: str) -> list[Document]:
        key = (query, self.topk, self.index)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self.hits += 1
                return found
            self.misses += 1
        found = call_with_service_wait(lambda: self.client.search([query], topk=self.topk, index=self.index)[0],
                                       getattr(self.client, "target", "?"), "retriever", self.service_wait_s,
                                       self.stats)
        docs = [clean_doc(d) for d in found]
        with self._lock:
            self._cache[key] = docs
        return docs

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


@dataclass
class EnvTimes:
    """Seconds spent waiting on each service (summed over threads), for "where the time goes"."""

    generate_s: float = 0.0
    search_s: float = 0.0
    generate_calls: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, field_name: str, seconds: float) -> None:
        with self._lock:
            setattr(self, field_name, getattr(self, field_name) + seconds)
            if field_name == "generate_s":
                self.generate_calls += 1


class ServiceEnv:
    """expand / rollout / reward of one question for :func:`prorag.search.mcts.search`.

    policy: a PolicyClient; search: a CachedSearch; tokenizer: the policy's (to encode the prompt and glue and
    to decode generated ids); golden: the question's gold answers (the terminal reward is token F1 against
    them, with the shared normaliser)."""

    def __init__(self, policy, search: CachedSearch, tokenizer, question: str, golden: Sequence[str], *,
                 temperature: float = 1.0, rollout_temperature: float = 1.0, max_step_tokens: int = 128,
                 max_steps: int = 10, max_len: int = 4096, adapter: str = "", seed: int = 0,
                 times: EnvTimes | None = None, service_wait_s: float = 0.0, stats: dict | None = None):
        self.policy, self.search, self.tok = policy, search, tokenizer
        # a policy that goes away (UNAVAILABLE) is waited for this long, in all per call, and asked again with the
        # same request (the same seed), so a seeded search ends as it would have
        self.service_wait_s, self.stats = service_wait_s, stats if stats is not None else {}
        self.golden = list(golden)
        self.temperature, self.rollout_temperature = temperature, rollout_temperature
        self.max_step_tokens, self.max_steps, self.max_len = max_step_tokens, max_steps, max_len
        self.adapter, self.seed = adapter, seed
        self.times = times or EnvTimes()
        self._calls = 0
        self.prompt_ids = tokenizer.encode(render_prompt(question), add_special_tokens=False)
        # id(step) -> its generated ids + its glue ids; steps live in the tree for the whole search
        self._ids: dict[int, list[int]] = {}
        # id(step) -> how many of those ids the policy generated (the rest is glue)
        self._generated: dict[int, int] = {}

    # -- helpers
    def prefix(self, history: Sequence[Step]) -> list[int]:
        ids = list(self.prompt_ids)
        for s in history:
            ids += self._ids[id(s)]
        return ids

    def _next_seed(self) -> int:
        # distinct seeds per call keep a seeded run's samples reproducible and its siblings different
        self._calls += 1
        return 0 if not self.seed else (self.seed * 1_000_003 + self._calls) % (2 ** 62)

    def _generate(self, prefix: list[int], n: int, temperature: float):
        t = time.monotonic()
        sampling = self.policy.sampling(n=n, temperature=temperature, max_tokens=self.max_step_tokens,
                                        seed=self._next_seed())  # drawn once: a retry asks with the same seed
        resp = call_with_service_wait(lambda: self.policy.generate_steps([prefix], sampling, adapter=self.adapter),
                                      getattr(self.policy, "target", "?"), "policy", self.service_wait_s,
                                      self.stats)
        self.times.add("generate_s", time.monotonic() - t)
        return list(resp.results[0].completions)

    def _finish_step(self, gen_ids: list[int]) -> Step:
        """Parse a generated step, search when it is a subquery, and remember its ids with the glue."""
        step = parse_step(decode(self.tok, gen_ids))
        if step.kind == "subquery":
            t = time.monotonic()
            step.docs = self.search(step.content)
            self.times.add("search_s", time.monotonic() - t)
        glue = glue_after(step)
        self._ids[id(step)] = list(gen_ids) + (self.tok.encode(glue, add_special_tokens=False) if glue else [])
        self._generated[id(step)] = len(gen_ids)
        return step

    # -- the three callables of prorag.search.mcts.search
    def expand(self, history: Sequence[Step], n: int) -> tuple[list[Step], int]:
        prefix = self.prefix(history)
        if len(prefix) >= self.max_len:
            return [], 0
        completions = self._generate(prefix, n, self.temperature)
        steps = [self._finish_step(list(c.token_ids)) for c in completions]
        return steps, sum(len(c.token_ids) for c in completions)

    def _counterfactual(self, ids: list[int], n: int) -> tuple[list[Step], int]:
        """``n`` steps sampled after the token ids of a context the trajectory never had (parsed, not searched, not
        remembered as prefixes), and the tokens generated; none when the context is past the length limit."""
        if len(ids) >= self.max_len:
            return [], 0
        completions = self._generate(ids, n, self.temperature)
        return ([parse_step(decode(self.tok, list(c.token_ids))) for c in completions],
                sum(len(c.token_ids) for c in completions))

    def expand_reading(self, history: Sequence[Step], docs: Sequence[Document], n: int) -> tuple[list[Step], int]:
        """``n`` next steps sampled after ``history`` (which ends with a searched subquery) as if that search had
        returned ``docs``: what the policy writes when it reads other documents. The steps are not searched and
        not remembered as prefixes: they are siblings to judge in the real context (where what they name is, or is
        not, what the real documents say)."""
        if not history or history[-1].kind != "subquery" or history[-1].docs is None:
            raise ValueError("expand_reading continues a searched subquery")
        last = history[-1]
        ids = self.prefix(history[:-1]) + self._ids[id(last)][:self._generated[id(last)]]
        ids += self.tok.encode(retrieval_block(docs), add_special_tokens=False)
        return self._counterfactual(ids, n)

    def expand_relation(self, history: Sequence[Step], asked: str, n: int) -> tuple[list[Step], int]:
        """``n`` next steps sampled after ``history`` (which ends with a searched subquery) as if that subquery had
        asked ``asked`` and the search had returned the same documents: what the policy reads there about another
        relation. Not searched, not remembered as prefixes: siblings to judge in the real context."""
        if not history or history[-1].kind != "subquery" or history[-1].docs is None:
            raise ValueError("expand_relation continues a searched subquery")
        last = history[-1]
        other = Step("subquery", thought=last.thought, content=asked, docs=list(last.docs))
        ids = self.prefix(history[:-1]) + self.tok.encode(render_step(other), add_special_tokens=False)
        return self._counterfactual(ids, n)

    def expand_bridge(self, history: Sequence[Step], name: str, n: int) -> tuple[list[Step], int]:
        """``n`` next steps sampled after ``history`` (which ends with a sub-answer) as if that sub-answer had said
        ``name``: what the policy asks next when it carries another name forward. Not searched, not remembered as
        prefixes: siblings to judge in the real context (where a search for that name is the wrong entity)."""
        if not history or history[-1].kind != "subanswer":
            raise ValueError("expand_bridge continues a sub-answer")
        said = Step("subanswer", thought=history[-1].thought, content=name)
        ids = self.prefix(history[:-1]) + self.tok.encode(render_step(said), add_special_tokens=False)
        return self._counterfactual(ids, n)

    def rollout(self, history: Sequence[Step]) -> tuple[float, int]:
        """One sampled completion from ``history`` to a final answer (or the step/length limit)."""
        steps, tokens = list(history), 0
        while len(steps) < self.max_steps:
            prefix = self.prefix(steps)
            if len(prefix) >= self.max_len:
                break
            c = self._generate(prefix, 1, self.rollout_temperature)[0]
            tokens += len(c.token_ids)
            step = self._finish_step(list(c.token_ids))
            steps.append(step)
            if step.kind in ("answer", "invalid"):
                break
        return self.reward(steps), tokens

    def reward(self, history: Sequence[Step]) -> float:
        last = history[-1] if history else None
        if last is None or last.kind != "answer":
            return 0.0
        return f1_score(last.content, self.golden)


def questions_to_search(cfg) -> list:
    """A searching stage's questions: the first ``cfg.max_questions`` (0 = all) of split ``cfg.split`` of world
    ``cfg.world``; never the test split, since what is found there becomes training data."""
    if cfg.split in TEST_SPLITS:
        raise InvalidArgument(f"split {cfg.split!r} is held out for evaluation; search the train (or dev) split")
    qs = load_split(paths.world_dir(cfg.world), cfg.split)
    if cfg.max_questions:
        qs = qs[:cfg.max_questions]
    if not qs:
        raise FailedPrecondition(f"no questions in split {cfg.split!r} of world {cfg.world!r}")
    return qs


def resume_questions(ctx, cfg, journal_name: str, done_verb: str) -> tuple[list, dict, Path, dict[str, dict], list]:
    """Where a searching stage's job stands: its questions (:func:`questions_to_search`), them by id, its journal
    in the checkpoint directory (one row per finished question, prorag.io.append_jsonl_synced), the journalled
    rows by question id (a question whose line a kill tore is done again) and the questions left; the counts are
    emitted as the job's first progress ("<n> already <done_verb>")."""
    qs = questions_to_search(cfg)
    by_id = {q.id: q for q in qs}
    journal = ctx.checkpoint_dir / journal_name
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    done = {row["question_id"]: row for row in read_jsonl_journal(journal) if row["question_id"] in by_id}
    todo = [q for q in qs if q.id not in done]
    ctx.emit(len(done), len(qs), message=f"{len(qs)} questions, {len(done)} already {done_verb}, "
                                         f"{cfg.concurrency} at a time")
    return qs, by_id, journal, done, todo


def run_questions(ctx, todo: list, work: Callable[[Any], dict], *, concurrency: int, thread_name: str,
                  journal: Path, done: dict[str, dict], total: int) -> list[dict]:
    """``work(question) -> row`` for each question left, ``concurrency`` at a time; each row is journalled
    (fsynced) and counted in ``done`` as its question finishes. Returns the rows this run added. Once a question
    fails (a service that did not come back) no other starts and the failure is raised; a stop request starts no
    other either, and is raised when the running ones are finished."""
    lock = threading.Lock()
    failed = threading.Event()
    fresh: list[dict] = []

    def one(q) -> None:
        if ctx.should_stop() or failed.is_set():
            return
        try:
            row = work(q)
        except BaseException:
            failed.set()
            raise
        with lock:
            append_jsonl_synced(journal, row)
            done[q.id] = row
            fresh.append(row)
            ctx.emit(len(done), total, message="")

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=thread_name) as pool:
        for fut in [pool.submit(one, q) for q in todo]:
            fut.result()
    ctx.check_stop()
    return fresh


class SearchServices:
    """What a searching stage (MCTS, siblings) calls, set up once per job: the policy and retriever clients, the
    run-wide search cache, the time spent waiting on each, and per service how many calls were asked again after
    it came back. A context manager: the clients are closed at the end.

    cfg: the stage's config (policy, retriever, topk, retriever_index, service_wait_s; for :meth:`env` also
    temperature, max_step_tokens, max_len, adapter, seed)."""

    SERVICES = ("policy", "retriever", "judge")

    def __init__(self, cfg):
        self.cfg = cfg
        self.policy = PolicyClient(cfg.policy, timeout=600)
        self.retriever = RetrieverClient(cfg.retriever, timeout=300)
        self.waits: dict[str, dict] = {what: {"service_retries": 0} for what in self.SERVICES}
        self.cache = CachedSearch(self.retriever, topk=cfg.topk, index=cfg.retriever_index,
                                  service_wait_s=cfg.service_wait_s, stats=self.waits["retriever"])
        self.times = EnvTimes()

    def env(self, tokenizer, question, seed: int, max_steps: int, **kwargs) -> ServiceEnv:
        """The environment of one question (a :class:`prorag.data.loaders.Question`); seed 0 = unseeded."""
        cfg = self.cfg
        return ServiceEnv(self.policy, self.cache, tokenizer, question.question, question.golden_answers,
                          temperature=cfg.temperature, max_step_tokens=cfg.max_step_tokens, max_steps=max_steps,
                          max_len=cfg.max_len, adapter=cfg.adapter, seed=seed, times=self.times,
                          service_wait_s=cfg.service_wait_s, stats=self.waits["policy"], **kwargs)

    def metrics(self) -> dict:
        """The job metrics about the services: cache, waits, calls, retries (in all and per service)."""
        return {"retrieval_cache_hit_rate": self.cache.hit_rate, "retrieval_searches": self.cache.misses,
                "policy_wait_s": self.times.generate_s, "retriever_wait_s": self.times.search_s,
                "policy_calls": self.times.generate_calls,
                "service_retries": sum(w["service_retries"] for w in self.waits.values()),
                **{f"{what}_retries": w["service_retries"] for what, w in self.waits.items()}}

    def close(self) -> None:
        self.policy.close()
        self.retriever.close()

    def __enter__(self) -> "SearchServices":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CachedSearch", "EnvTimes", "SearchServices", "ServiceEnv", "questions_to_search"]
