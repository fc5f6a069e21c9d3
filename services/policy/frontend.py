"""The policy's request path, shared by the gRPC servicer and the OpenAI-compatible HTTP API: every check of a
request and the limits it is held to (services.policy.requests), admission of rollouts, then the scheduler's
batched engine calls. The transports only convert their wire types; the engine trusts what reaches it."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from prorag.engine import GeneratedSeq, SamplingSpec, check_logprobs_served, derive_seed
from prorag.errors import InvalidArgument, NotFound, ResourceExhausted
from prorag.registry import ArtifactRef
from prorag.rollout import TrajectoryResult, decode
from prorag.trajectory import STOP_TAGS
from services.policy.config import PolicyConfig
from services.policy.manager import AdapterManager, LoadedAdapter
from services.policy.requests import RequestChecks
from services.policy.retriever_client import RetrieverSearch
from services.policy.rollouts import RolloutRunner, RolloutSummary
from services.policy.scheduler import GenerationScheduler


@dataclass(frozen=True)
class SamplingRequest:
    """A request's sampling as the wire gives it: 0 means the default (max_tokens) or none (seed)."""

    n: int = 0
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    seed: int = 0
    stops: tuple[str, ...] = ()
    tempered_logprobs: bool | None = None  # None: the engine's own kind


@dataclass(frozen=True)
class StepCompletion:
    """One sampled continuation of a prefix, decoded, with the stop that ended it named."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop: str


class PolicyFrontend:
    def __init__(self, engine, scheduler: GenerationScheduler, manager: AdapterManager, limits: PolicyConfig,
                 retriever: RetrieverSearch, model_info: dict):
        self.engine, self.scheduler, self.manager, self.limits = engine, scheduler, manager, limits
        self.model_info = model_info
        self.tokenizer = engine.tokenizer
        # the format's stop tags that are one token of this model: a step's default stops
        self.stop_ids: dict[str, int] = {}
        for tag in STOP_TAGS:
            ids = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1:
                self.stop_ids[tag] = ids[0]
        self._tag_of_stop = {v: k for k, v in self.stop_ids.items()}
        vocab = engine.vocab_size if hasattr(engine, "vocab_size") else len(self.tokenizer)
        self.checks = RequestChecks(limits, self.tokenizer, vocab, engine.max_model_len, self.stop_ids)
        self.rollouts = RolloutRunner(scheduler, manager, retriever, self.tokenizer, limits.max_concurrent_rollouts)
        self._rollouts_admitted = 0  # running + queued; touched only on the event loop

    def sampling(self, sampling: SamplingRequest, *, default_max_tokens: int) -> SamplingSpec:
        spec = self.checks.sampling(n=sampling.n, max_tokens=sampling.max_tokens or default_max_tokens,
                                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                    stops=list(sampling.stops), field="sampling.", default_hint=True,
                                    tempered_logprobs=sampling.tempered_logprobs)
        check_logprobs_served(spec, self.engine.logprobs_served, self.engine.name)
        return spec

    def _prompt(self, i: int, prefix: Sequence[int] | str) -> list[int]:
        """A prefix given as token ids or as text ('' and no ids is refused as empty)."""
        return self.checks.encode(i, prefix) if isinstance(prefix, str) else self.checks.prompt_ids(i, prefix)

    async def generate_steps(self, prefixes: Sequence[Sequence[int] | str], sampling: SamplingRequest, adapter: str,
                             deadline: float | None) -> tuple[list[list[StepCompletion]], str]:
        """Per prefix its completions, and the adapter version that wrote them ('' = the base model)."""
        L = self.limits
        self.checks.count(len(prefixes), "prefixes", L.max_prefixes)
        spec = self.sampling(sampling, default_max_tokens=L.default_step_tokens)
        L.check_work(len(prefixes) * spec.n * spec.max_tokens,
                     f"{len(prefixes)} prefixes x n={spec.n} x max_tokens={spec.max_tokens}")
        outs, version = await self.generate([self._prompt(i, p) for i, p in enumerate(prefixes)], spec, adapter,
                                            deadline)
        return [[self._completion(s) for s in seqs] for seqs in outs], version or ""

    async def generate(self, prompts: list[list[int]], spec: SamplingSpec, adapter: str,
                       deadline: float | None) -> tuple[list[list[GeneratedSeq]], str | None]:
        """Checked prompts through the scheduler, batched with concurrent callers: (per prompt its samples, the
        adapter that wrote them or None); prompt i samples from a seed derived from spec.seed and i."""
        seeds = [derive_seed(spec.seed, i) for i in range(len(prompts))]
        with self.manager.acquire(adapter) as version:
            return await self.scheduler.generate(prompts, spec, version, seeds, deadline), version

    def _completion(self, seq: GeneratedSeq) -> StepCompletion:
        # a stop that is no tag is reported as its token's text
        stop = self._tag_of_stop.get(seq.stop_token_id) or (
            "" if seq.stop_token_id is None else decode(self.tokenizer, [seq.stop_token_id]))
        return StepCompletion(list(seq.token_ids), list(seq.logprobs), decode(self.tokenizer, seq.token_ids),
                              seq.finish_reason, stop)

    def _check_rollout(self, questions: Sequence[tuple[str, str]], sampling: SamplingRequest, max_steps: int,
                       topk: int, question_offset: int) -> tuple[SamplingSpec, int, int]:
        """(sampling, max_steps, topk) with the defaults filled in, after every check of the request's values."""
        L = self.limits
        self.checks.count(len(questions), "questions", L.max_questions)
        if question_offset < 0:
            raise InvalidArgument(f"question_offset is {question_offset}; it is the place of the request's first "
                                  "question in the request it was split from, >= 0 (0 for a request on its own)")
        for i, (qid, question) in enumerate(questions):
            if not question.strip():
                raise InvalidArgument(f"question {i} ({qid!r}) is empty")
            if len(question) > L.max_question_chars:
                raise InvalidArgument(f"question {i} has {len(question)} characters; at most {L.max_question_chars}")
        spec = self.sampling(sampling, default_max_tokens=L.default_step_tokens)
        steps = max_steps or L.default_max_steps
        if not 1 <= steps <= L.max_steps:
            raise InvalidArgument(f"max_steps is {max_steps}; allowed 1..{L.max_steps} (0 = default)")
        k = topk or L.default_topk
        if not 1 <= k <= L.max_topk:
            raise InvalidArgument(f"topk is {topk}; allowed 1..{L.max_topk} (0 = default)")
        L.check_work(len(questions) * spec.n * steps * spec.max_tokens,
                     f"{len(questions)} questions x n={spec.n} x max_steps={steps} x max_tokens={spec.max_tokens}")
        return spec, steps, k

    async def rollout(self, questions: Sequence[tuple[str, str]], sampling: SamplingRequest, *, max_steps: int,
                      topk: int, retriever_index: str, adapter: str, deadline: float | None,
                      question_offset: int = 0) -> AsyncIterator[tuple[TrajectoryResult, str] | RolloutSummary]:
        """Each finished trajectory with the adapter version that wrote it, as it finishes, then the summary.

        questions: (id, question) pairs; max_steps and topk 0 mean the server's defaults; question_offset: where
        the first question stood in the request a client split (seeds follow from that place). A request over the
        running and queued rollouts the server admits is refused (RESOURCE_EXHAUSTED) before any work."""
        L = self.limits
        spec, max_steps, topk = self._check_rollout(questions, sampling, max_steps, topk, question_offset)
        if self._rollouts_admitted >= L.max_concurrent_rollouts + L.max_queued_rollouts:
            raise ResourceExhausted(f"the policy is busy: {self._rollouts_admitted} rollout requests running or "
                                    f"queued (max_concurrent_rollouts {L.max_concurrent_rollouts} + "
                                    f"max_queued_rollouts {L.max_queued_rollouts}); retry with backoff")
        self._rollouts_admitted += 1
        try:
            async for event in self.rollouts.run(questions, spec, max_steps=max_steps, topk=topk,
                                                 retriever_index=retriever_index, adapter=adapter, deadline=deadline,
                                                 question_offset=question_offset):
                yield event
        finally:
            self._rollouts_admitted -= 1

    # -- adapters and the model --

    def adapter(self, key: str) -> LoadedAdapter:
        entry = self.manager.loaded.get(key)
        if entry is None:
            raise NotFound(f"adapter {key} is not loaded")
        return entry

    async def load_adapter(self, ref: ArtifactRef, path: str) -> LoadedAdapter:
        await self.manager.load(ref, path)
        return self.adapter(ref.key)

    async def activate_adapter(self, ref: ArtifactRef | None) -> LoadedAdapter | None:
        """Serve ``ref`` by default; None = the base model."""
        await self.manager.activate(ref)
        return None if ref is None else self.adapter(ref.key)

    async def unload_adapter(self, ref: ArtifactRef) -> None:
        await self.manager.unload(ref)

    def loaded_adapters(self) -> list[LoadedAdapter]:
        return [self.adapter(k) for k in self.manager.loaded]

    @property
    def active_adapter(self) -> str:
        return self.manager.active or ""

    def describe(self) -> dict:
        """The engine's own description with what this server adds: the served name, the replica, the adapter."""
        info = self.engine.info()
        # replica: which process answered, as callers behind a round-robin channel see it
        return {**info, "name": self.model_info["name"], "replica": f"{socket.gethostname()}:{os.getpid()}",
                "active_adapter": self.active_adapter}

    def close(self) -> None:
        self.rollouts.close()
