"""Judge engines. ``reference`` (the offline default) checks ProRAG's judging rules against the benchmark's gold
decomposition (prorag.search.judging); ``openai`` asks any OpenAI-compatible endpoint (GPT-4o in the paper, a vLLM
server, this project's policy service) with ProRAG's judging prompt, through a persistent cache and a budget."""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prorag.data.loaders import Question, load_split
from prorag.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ProragError,
                           ResourceExhausted, Unavailable)
from prorag.metrics import normalize_answer
from prorag.search.judging import MalformedJudgeReply, judge_step, pair_messages, parse_pair_reply, request_key
from prorag.trajectory import Step, render_step

SPLITS = ("train", "dev", "test")
log = logging.getLogger("prorag.judge")


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
    cached: bool = False  # served from the persistent cache (no paid call)


class ReferenceJudge:
    """Judges against the gold decompositions of one world's splits (found by question id, else by text)."""

    backend = "reference"
    model = "gold-decomposition"

    def __init__(self, questions: Sequence[Question]):
        self.by_id = {q.id: q for q in questions}
        self.by_text = {normalize_answer(q.question): q for q in questions}
        self._requests_answered = 0
        self._count_lock = threading.Lock()  # judge() runs on several threads at once

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
        with self._count_lock:
            self._requests_answered += 1
        return out

    def info(self) -> dict:
        # no paid calls: calls_made counts the requests it answered
        return {"cache_entries": 0, "calls_made": self._requests_answered, "budget_left_usd": 0.0, "cost_usd": 0.0}


class JudgeCache:
    """Verdicts by request content key (prorag.search.judging.request_key), appended to a JSONL file and fsynced, so a
    paid request is never made twice, across restarts too. A torn last line (a killed process) is skipped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._rows: dict[str, dict] = {}
        self._lock = threading.Lock()
        # a torn last line has no newline: the next row must start on a line of its own, or it is lost with it
        self._torn = False
        if self.path.is_file():
            text = self.path.read_text(encoding="utf-8", errors="replace")
            self._torn = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                    self._rows[row["key"]] = row
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> dict | None:
        with self._lock:
            return self._rows.get(key)

    def put(self, key: str, row: dict) -> None:
        row = {"key": key, **row}
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(("\n" if self._torn else "") + json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._torn = False
            self._rows[key] = row


@dataclass
class Budget:
    """Paid calls and dollars one judge process may spend (0 = no limit); prices per million tokens."""

    max_calls: int = 0
    max_cost_usd: float = 0.0
    usd_per_m_input: float = 2.5  # GPT-4o list price (2026); set per endpoint
    usd_per_m_output: float = 10.0

    def __post_init__(self):
        self.calls = 0
        self.cost_usd = 0.0
        self._lock = threading.Lock()

    def reserve(self) -> None:
        with self._lock:
            if self.max_calls and self.calls >= self.max_calls:
                raise ResourceExhausted(f"judge budget spent: {self.calls} of {self.max_calls} paid calls made; "
                                        "cached verdicts are still served (raise max_calls to judge new pairs)")
            if self.max_cost_usd and self.cost_usd >= self.max_cost_usd:
                raise ResourceExhausted(f"judge budget spent: ${self.cost_usd:.4f} of ${self.max_cost_usd:.4f}; "
                                        "cached verdicts are still served (raise max_cost_usd to judge new pairs)")
            self.calls += 1

    def charge(self, prompt_tokens: int, completion_tokens: int) -> float:
        cost = (prompt_tokens * self.usd_per_m_input + completion_tokens * self.usd_per_m_output) / 1e6
        with self._lock:
            self.cost_usd += cost
        return cost

    def left_usd(self) -> float:
        return max(0.0, self.max_cost_usd - self.cost_usd) if self.max_cost_usd else float("inf")


class OpenAIJudge:
    """ProRAG's LLM judge over an OpenAI-compatible chat endpoint: one request per sibling pair, the reply parsed
    by prorag.search.judging.parse_pair_reply (the judge may decline), cached by content, within a call/cost budget.

    Transport failures are retried here, not inside the openai client, so each one is counted and logged: timeouts,
    refused or dropped connections, 408/409/429 and 5xx, and a 200 whose body is not a chat completion, up to
    ``max_retries`` times with exponential backoff, or after the endpoint's Retry-After when it sends one (a
    Retry-After beyond ``max_retry_after_s`` fails at once: waiting that long would hold the caller's RPC). A
    reply that is not a usable choice is asked again up to ``malformed_retries`` times. What is still failing
    then fails the request with the reason (UNAVAILABLE, or DEADLINE_EXCEEDED after timeouts): a bad upstream,
    never a label. ``info()["counters"]`` holds the counts."""

    RETRY_STATUS = frozenset({408, 409, 429})  # and every 5xx

    backend = "openai"

    def __init__(self, base_url: str, model: str, cache: JudgeCache, budget: Budget, api_key: str = "",
                 timeout_s: float = 60.0, max_retries: int = 4, malformed_retries: int = 2,
                 temperature: float = 0.0, max_tokens: int = 128, concurrency: int = 8,
                 backoff_s: float = 0.5, max_backoff_s: float = 8.0, max_retry_after_s: float = 30.0):
        import openai  # optional (prorag[openai]): only the openai backend needs it

        self.model = model
        self.cache, self.budget = cache, budget
        self.params = {"temperature": temperature, "max_tokens": max_tokens}
        self.max_retries, self.malformed_retries = max_retries, malformed_retries
        self.backoff_s, self.max_backoff_s, self.max_retry_after_s = backoff_s, max_backoff_s, max_retry_after_s
        # max_retries=0: the client's own retries would be invisible (uncounted) and honour a Retry-After of up
        # to a minute; _ask retries instead
        self.client = openai.OpenAI(base_url=base_url or None, api_key=api_key or "none", timeout=timeout_s,
                                    max_retries=0)
        self.cached_hits = 0
        self.concurrency = concurrency
        self.counters: dict[str, int] = {}
        self._counters_lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._counters_lock:
            self.counters[name] = self.counters.get(name, 0) + 1

    def _retry_after(self, headers) -> float | None:
        """Seconds the endpoint asked us to wait (Retry-After-Ms, Retry-After as seconds or an HTTP date)."""
        if headers is None:
            return None
        for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
            value = headers.get(name)
            if value is None:
                continue
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                when = email.utils.parsedate_to_datetime(value) if name == "retry-after" else None
                if when is not None:
                    return max(0.0, when.timestamp() - time.time())
        return None

    def _attempt(self, messages: list[dict]) -> tuple[str, dict]:
        """One HTTP request; raises _Retry for what a later attempt may cure, a ProragError for what it cannot."""
        import openai  # optional (prorag[openai]): only the openai backend needs it

        try:
            resp = self.client.chat.completions.create(model=self.model, messages=messages, **self.params)
        except openai.APITimeoutError as e:
            raise _Retry("timeout", DeadlineExceeded(f"judge endpoint timed out: {e}")) from None
        except openai.APIConnectionError as e:
            raise _Retry("connection", Unavailable(f"judge endpoint unreachable: {e}")) from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
            raise FailedPrecondition(f"the judge endpoint refused this server's API key: {e}") from None
        except openai.BadRequestError as e:
            raise FailedPrecondition(f"the judge endpoint refused the request (model {self.model!r}?): {e}") from None
        except openai.APIStatusError as e:
            code = e.status_code
            err = Unavailable(f"judge endpoint failed with HTTP {code}"
                              + (" (rate-limited)" if code == 429 else "") + f": {str(e)[:200]}")
            if code in self.RETRY_STATUS or code >= 500:
                raise _Retry(f"http_{code}", err, self._retry_after(e.response.headers)) from None
            raise err from None
        except (openai.APIError, ValueError) as e:  # a 200 whose body does not parse (JSON or schema)
            raise _Retry("bad_response", Unavailable(f"judge endpoint sent an unreadable reply: {e}")) from None
        try:
            text = resp.choices[0].message.content or ""
            usage = resp.usage
        except (AttributeError, IndexError, TypeError, KeyError) as e:  # e.g. {"choices": []}, or a bare string
            raise _Retry("bad_response", Unavailable(f"judge endpoint sent a reply that is no chat completion "
                                                     f"({type(e).__name__}: {e}): {str(resp)[:200]!r}")) from None
        tokens = {"prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
                  "completion_tokens": getattr(usage, "completion_tokens", 0) or 0}
        return text, tokens

    def _ask(self, messages: list[dict]) -> tuple[str, dict]:
        for attempt in range(1 + self.max_retries):
            self._count("requests")
            try:
                return self._attempt(messages)
            except _Retry as r:
                self._count(f"errors.{r.reason}")
                last = r
            except Exception:
                self._count("failed")
                raise
            if attempt == self.max_retries:
                break
            if last.retry_after is not None and last.retry_after > self.max_retry_after_s:
                self._count("failed")
                raise Unavailable(f"{last.error} (the endpoint asks to retry after {last.retry_after:.0f} s, more than "
                                  f"max_retry_after_s={self.max_retry_after_s:.0f}; not retried)") from None
            wait = last.retry_after if last.retry_after is not None else \
                min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * random.uniform(0.75, 1.0)
            self._count("retries")
            log.warning("judge endpoint: %s (attempt %d of %d); retrying in %.2f s", last.error, attempt + 1,
                        1 + self.max_retries, wait)
            time.sleep(wait)
        self._count("failed")
        err = last.error
        log.error("judge endpoint: giving up after %d attempt(s): %s", 1 + self.max_retries, err)
        raise type(err)(f"{err} (after {1 + self.max_retries} attempt(s))") from None

    def judge_one(self, item: PairRequest) -> Judgement:
        if len(item.candidates) != 2:
            raise InvalidArgument(f"item {item.id!r}: the openai judge compares exactly two sibling steps, got "
                                  f"{len(item.candidates)} (send one item per pair)")
        context = "".join(render_step(s) for s in item.history)
        a, b = (render_step(c) for c in item.candidates)
        messages = pair_messages(item.question, context, a, b)
        key = request_key(self.model, messages, self.params)
        hit = self.cache.get(key)
        if hit is not None:
            self.cached_hits += 1
            self._count("cache_hits")
            return Judgement(item.id, hit["chosen"], hit["rejected"], hit["reason"], cached=True)
        last = None
        for _ in range(1 + self.malformed_retries):
            self.budget.reserve()
            text, usage = self._ask(messages)
            self.budget.charge(usage["prompt_tokens"], usage["completion_tokens"])
            try:
                pj = parse_pair_reply(text)
            except MalformedJudgeReply as e:
                self._count("malformed_replies")
                log.warning("judge endpoint: item %r: %s", item.id, e)
                last = e
                continue
            chosen = -1 if pj.chosen is None else int(pj.chosen)
            rejected = -1 if pj.rejected is None else int(pj.rejected)
            self.cache.put(key, {"chosen": chosen, "rejected": rejected, "reason": pj.reason, "model": self.model,
                                 "usage": usage})
            self._count("labelled")
            return Judgement(item.id, chosen, rejected, pj.reason)
        self._count("failed")
        raise MalformedJudgeReply(f"item {item.id!r}: no usable choice in {1 + self.malformed_retries} replies "
                                  f"from {self.model!r}; last: {last}")

    def judge(self, items: Sequence[PairRequest]) -> list[Judgement]:
        """Items in order; up to ``concurrency`` requests in flight (an endpoint's latency, not its compute,
        bounds one request at a time)."""
        if len(items) <= 1 or self.concurrency <= 1:
            return [self.judge_one(it) for it in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            return list(pool.map(self.judge_one, items))

    def info(self) -> dict:
        left = self.budget.left_usd()
        with self._counters_lock:
            counters = dict(self.counters)
        return {"cache_entries": len(self.cache), "calls_made": self.budget.calls,
                "budget_left_usd": left if left != float("inf") else -1.0, "cost_usd": self.budget.cost_usd,
                "counters": counters}


class _Retry(Exception):
    """A failed attempt a later one may cure: ``reason`` names its counter, ``error`` is what the caller gets
    when no attempt is left, ``retry_after`` the wait the endpoint asked for (seconds), if any."""

    def __init__(self, reason: str, error: ProragError, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.error, self.retry_after = reason, error, retry_after
