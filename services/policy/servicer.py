"""Thin gRPC servicer for prorag.v1.Policy: validate, convert, call the scheduler/manager."""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from prorag.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted
from prorag.pb import common_pb2, policy_pb2, policy_pb2_grpc
from prorag.rpc.pbconv import step_pb, token_trace_pb
from prorag.trajectory import STOP_TAGS
from prorag.registry import ArtifactRef
from prorag.engine import SamplingSpec, derive_seed
from prorag.rollout import TrajectoryResult, decode, run_rollouts
from services.policy.manager import AdapterManager
from services.policy.requests import RequestChecks
from services.policy.scheduler import GenerationScheduler
from services.policy.config import PolicyConfig
from services.policy.retriever_client import RetrieverSearch


def _deadline(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class RolloutGuard:
    """Stops a rollout between engine and retriever calls once its caller has gone or its deadline passed,
    so neither a cancelled nor an overdue rollout keeps the engine busy (each engine call is itself
    bounded by max_tokens)."""

    def __init__(self, engine, search, deadline: float | None):
        self.engine, self._search, self.deadline = engine, search, deadline
        self.cancelled = threading.Event()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.rounds = 0

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled("the caller cancelled the rollout")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"the rollout ran past its deadline after {self.rounds} engine calls; "
                                   "give it a longer deadline or fewer questions")

    def generate(self, prompts, params, adapter=None, seeds=None):
        self.check()
        self.rounds += 1
        return self.engine.generate(prompts, params, adapter, seeds)

    def search(self, queries, topk):
        self.check()
        return self._search(queries, topk)

    def __getattr__(self, name):  # the rest of the engine interface (info, adapters, ...)
        return getattr(self.engine, name)


def trajectory_pb(t: TrajectoryResult, adapter_version: str) -> policy_pb2.Trajectory:
    return policy_pb2.Trajectory(
        question_id=t.question_id, sample_index=t.sample_index, question=t.question,
        steps=[step_pb(s) for s in t.steps], answer=t.answer or "", format_valid=t.format_valid,
        finish_reason=t.finish_reason, prompt_length=t.tokens.prompt_length, adapter_version=adapter_version,
        text=t.text, trace=token_trace_pb(t.tokens))


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, engine, scheduler: GenerationScheduler, manager: AdapterManager, limits: PolicyConfig,
                 retriever: RetrieverSearch, model_info: dict):
        self.engine = engine
        self.scheduler = scheduler
        self.manager = manager
        self.limits = limits
        self.retriever = retriever
        self.model_info = model_info
        self.tokenizer = engine.tokenizer
        self._stop_ids = {}
        for tag in STOP_TAGS:
            ids = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1:
                self._stop_ids[tag] = ids[0]
        vocab = engine.vocab_size if hasattr(engine, "vocab_size") else len(self.tokenizer)
        self.checks = RequestChecks(limits, self.tokenizer, vocab, engine.max_model_len, self._stop_ids)
        self._rollout_pool = ThreadPoolExecutor(max_workers=limits.max_concurrent_rollouts,
                                                thread_name_prefix="rollout")
        self._rollouts_admitted = 0  # running + queued; touched only on the event loop

    # -- validation (the checks themselves: services.policy.requests, shared with the HTTP API) --
    def _sampling(self, sp: policy_pb2.SamplingParams, *, default_max_tokens: int) -> SamplingSpec:
        return self.checks.sampling(n=sp.n, max_tokens=sp.max_tokens or default_max_tokens,
                                    temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, stops=list(sp.stop),
                                    field="sampling.", default_hint=True)

    def _prefix_ids(self, i: int, prefix: policy_pb2.Prefix) -> list[int]:
        if prefix.token_ids:
            return self.checks.prompt_ids(i, prefix.token_ids)
        return self.checks.encode(i, prefix.text)

    # -- RPCs --
    async def GenerateSteps(self, request, context):
        self.checks.count(len(request.prefixes), "prefixes", self.limits.max_prefixes)
        spec = self._sampling(request.sampling, default_max_tokens=self.limits.default_step_tokens)
        self.limits.check_work(len(request.prefixes) * spec.n * spec.max_tokens,
                               f"{len(request.prefixes)} prefixes x n={spec.n} x max_tokens={spec.max_tokens}")
        prompts = [self._prefix_ids(i, p) for i, p in enumerate(request.prefixes)]
        seeds = [derive_seed(spec.seed, i) for i in range(len(prompts))]
        with self.manager.acquire(request.adapter) as adapter:
            outs = await self.scheduler.generate(prompts, spec, adapter, seeds, _deadline(context))
        stop_tag = {v: k for k, v in self._stop_ids.items()}  # a stop that is no tag is reported as its token
        results = []
        for seqs in outs:
            results.append(policy_pb2.PrefixCompletions(completions=[
                policy_pb2.Completion(token_ids=s.token_ids, logprobs=s.logprobs, text=decode(self.tokenizer, s.token_ids),
                                      finish_reason=s.finish_reason, stop=stop_tag.get(s.stop_token_id) or (
                                          "" if s.stop_token_id is None else decode(self.tokenizer, [s.stop_token_id])))
                for s in seqs]))
        return policy_pb2.GenerateStepsResponse(results=results, adapter_version=adapter or "")

    async def Rollout(self, request, context):
        L = self.limits
        self.checks.count(len(request.questions), "questions", L.max_questions)
        for i, q in enumerate(request.questions):
            if not q.question.strip():
                raise InvalidArgument(f"question {i} ({q.id!r}) is empty")
            if len(q.question) > L.max_question_chars:
                raise InvalidArgument(f"question {i} has {len(q.question)} characters; at most {L.max_question_chars}")
        spec = self._sampling(request.sampling, default_max_tokens=L.default_step_tokens)
        max_steps = request.max_steps or L.default_max_steps
        if not 1 <= max_steps <= L.max_steps:
            raise InvalidArgument(f"max_steps is {request.max_steps}; allowed 1..{L.max_steps} (0 = default)")
        topk = request.topk or L.default_topk
        if not 1 <= topk <= L.max_topk:
            raise InvalidArgument(f"topk is {request.topk}; allowed 1..{L.max_topk} (0 = default)")
        L.check_work(len(request.questions) * spec.n * max_steps * spec.max_tokens,
                     f"{len(request.questions)} questions x n={spec.n} x max_steps={max_steps} x "
                     f"max_tokens={spec.max_tokens}")
        if self._rollouts_admitted >= L.max_concurrent_rollouts + L.max_queued_rollouts:
            raise ResourceExhausted(f"the policy is busy: {self._rollouts_admitted} rollout requests running or "
                                    f"queued (max_concurrent_rollouts {L.max_concurrent_rollouts} + "
                                    f"max_queued_rollouts {L.max_queued_rollouts}); retry with backoff")
        self._rollouts_admitted += 1
        try:
            async for event in self._rollout(request, context, spec, max_steps, topk):
                yield event
        finally:
            self._rollouts_admitted -= 1

    async def _rollout(self, request, context, spec, max_steps: int, topk: int):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # in this context: the request id goes along
        await asyncio.to_thread(self.retriever.check_index, request.retriever_index)
        deadline = _deadline(context)
        started = time.monotonic()
        with self.manager.acquire(request.adapter) as adapter:
            guard = RolloutGuard(self.scheduler.sync_engine(deadline),
                                 self.retriever.search_fn(request.retriever_index, deadline), deadline)
            version = adapter or ""

            searches: dict = {}

            def work():
                return run_rollouts(guard, self.tokenizer, [(q.id or str(i), q.question)
                                                            for i, q in enumerate(request.questions)],
                                    spec, guard.search, max_steps=max_steps, topk=topk, adapter=adapter,
                                    on_finished=lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                                    stats=searches)

            # the copied context carries the request id to the retriever calls made from the rollout's thread
            fut = loop.run_in_executor(self._rollout_pool, contextvars.copy_context().run, work)
            fut.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
            total = len(request.questions) * spec.n
            sent, tokens = 0, 0
            try:
                while sent < total:
                    item = await queue.get()
                    if item is None:
                        break
                    sent += 1
                    tokens += item.tokens.generated_tokens
                    yield policy_pb2.RolloutEvent(trajectory=trajectory_pb(item, version))
                await fut  # re-raises a failure of the rollout (mapped by the interceptor)
            finally:
                if not fut.done():
                    # The caller went away (cancelled, deadline, disconnected): stop the work at its next
                    # engine or retriever call instead of finishing every question for nobody.
                    guard.cancelled.set()
        yield policy_pb2.RolloutEvent(summary=policy_pb2.RolloutSummary(
            num_trajectories=sent, generated_tokens=tokens, wall_s=time.monotonic() - started,
            adapter_version=version, searches_asked=searches.get("searches_asked", 0),
            searches_made=searches.get("searches_made", 0)))

    async def LoadAdapter(self, request, context):
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        await self.manager.load(ref, request.path)
        return self._status(ref.key)

    async def ActivateAdapter(self, request, context):
        if not request.ref.name:
            await self.manager.activate(None)
            return policy_pb2.AdapterStatus(active=True)
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        await self.manager.activate(ref)
        return self._status(ref.key)

    async def UnloadAdapter(self, request, context):
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        await self.manager.unload(ref)
        return policy_pb2.AdapterStatus(ref=common_pb2.AdapterRef(name=ref.name, version=ref.version), loaded=False)

    async def ListAdapters(self, request, context):
        return policy_pb2.ListAdaptersResponse(adapters=[self._status(k) for k in self.manager.loaded],
                                               active=self.manager.active or "")

    async def GetModelInfo(self, request, context):
        info = self.engine.info()
        return common_pb2.ModelInfo(model_id=self.model_info["model_id"],
                                    base_model_sha256=self.model_info["sha256"], engine=str(info.get("engine", "")),
                                    device=str(info.get("device", "")), num_parameters=int(info.get("num_parameters", 0)),
                                    extra={**{k: str(v) for k, v in info.items()}, "name": self.model_info["name"],
                                           # which replica answered: callers behind a round-robin channel see it
                                           "replica": f"{socket.gethostname()}:{os.getpid()}",
                                           "active_adapter": self.manager.active or ""})

    def _status(self, key: str) -> policy_pb2.AdapterStatus:
        entry = self.manager.loaded.get(key)
        if entry is None:
            raise NotFound(f"adapter {key} is not loaded")
        m = entry.manifest
        return policy_pb2.AdapterStatus(
            ref=common_pb2.AdapterRef(name=entry.ref.name, version=entry.ref.version), loaded=True,
            active=self.manager.active == key,
            manifest=policy_pb2.AdapterManifest(name=m.name, version=m.version, base_model=m.base_model,
                                                base_model_sha256=m.base_model_sha256, sha256=m.sha256,
                                                rank=m.rank, step=m.step, created_at=m.created_at))

    def close(self) -> None:
        self._rollout_pool.shutdown(wait=False, cancel_futures=True)
