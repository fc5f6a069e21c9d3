"""Thin gRPC servicer for prorag.v1.Policy: convert, call the front end (which checks, admits and batches)."""

from __future__ import annotations

from prorag.pb import common_pb2, policy_pb2, policy_pb2_grpc
from prorag.registry import ArtifactRef
from prorag.rollout import TrajectoryResult
from prorag.rpc.grpc_server import deadline_of
from prorag.rpc.pbconv import step_pb, token_trace_pb
from services.policy.frontend import PolicyFrontend, SamplingRequest
from services.policy.manager import LoadedAdapter
from services.policy.rollouts import RolloutSummary


def sampling_request(sp: policy_pb2.SamplingParams) -> SamplingRequest:
    return SamplingRequest(n=sp.n, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                           seed=sp.seed, stops=tuple(sp.stop),
                           tempered_logprobs=sp.tempered_logprobs if sp.HasField("tempered_logprobs") else None)


def trajectory_pb(t: TrajectoryResult, adapter_version: str) -> policy_pb2.Trajectory:
    return policy_pb2.Trajectory(
        question_id=t.question_id, sample_index=t.sample_index, question=t.question,
        steps=[step_pb(s) for s in t.steps], answer=t.answer or "", format_valid=t.format_valid,
        finish_reason=t.finish_reason, prompt_length=t.tokens.prompt_length, adapter_version=adapter_version,
        text=t.text, trace=token_trace_pb(t.tokens))


def summary_pb(s: RolloutSummary) -> policy_pb2.RolloutSummary:
    return policy_pb2.RolloutSummary(num_trajectories=s.num_trajectories, generated_tokens=s.generated_tokens,
                                     wall_s=s.wall_s, adapter_version=s.adapter_version,
                                     searches_asked=s.searches_asked, searches_made=s.searches_made)


def adapter_status_pb(entry: LoadedAdapter, active: bool) -> policy_pb2.AdapterStatus:
    m = entry.manifest
    return policy_pb2.AdapterStatus(
        ref=common_pb2.AdapterRef(name=entry.ref.name, version=entry.ref.version), loaded=True, active=active,
        manifest=policy_pb2.AdapterManifest(name=m.name, version=m.version, base_model=m.base_model,
                                            base_model_sha256=m.base_model_sha256, sha256=m.sha256,
                                            rank=m.rank, step=m.step, created_at=m.created_at))


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, frontend: PolicyFrontend):
        self.frontend = frontend

    def _status(self, entry: LoadedAdapter) -> policy_pb2.AdapterStatus:
        return adapter_status_pb(entry, active=self.frontend.active_adapter == entry.ref.key)

    async def GenerateSteps(self, request, context):
        # a prefix's token ids win over its text; neither is refused as empty by the front end
        prefixes = [list(p.token_ids) if p.token_ids else p.text for p in request.prefixes]
        results, version = await self.frontend.generate_steps(prefixes, sampling_request(request.sampling),
                                                               request.adapter, deadline_of(context))
        return policy_pb2.GenerateStepsResponse(adapter_version=version, results=[
            policy_pb2.PrefixCompletions(completions=[
                policy_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs, text=c.text,
                                      finish_reason=c.finish_reason, stop=c.stop) for c in completions])
            for completions in results])

    async def Rollout(self, request, context):
        events = self.frontend.rollout([(q.id, q.question) for q in request.questions],
                                       sampling_request(request.sampling), max_steps=request.max_steps,
                                       topk=request.topk, retriever_index=request.retriever_index,
                                       adapter=request.adapter, question_offset=request.question_offset,
                                       deadline=deadline_of(context))
        async for event in events:
            if isinstance(event, RolloutSummary):
                yield policy_pb2.RolloutEvent(summary=summary_pb(event))
            else:
                yield policy_pb2.RolloutEvent(trajectory=trajectory_pb(*event))

    async def LoadAdapter(self, request, context):
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        return self._status(await self.frontend.load_adapter(ref, request.path))

    async def ActivateAdapter(self, request, context):
        if not request.ref.name:  # no name: serve the base model
            await self.frontend.activate_adapter(None)
            return policy_pb2.AdapterStatus(active=True)
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        return self._status(await self.frontend.activate_adapter(ref))

    async def UnloadAdapter(self, request, context):
        ref = ArtifactRef.of(request.ref.name, request.ref.version)
        await self.frontend.unload_adapter(ref)
        return policy_pb2.AdapterStatus(ref=common_pb2.AdapterRef(name=ref.name, version=ref.version), loaded=False)

    async def ListAdapters(self, request, context):
        return policy_pb2.ListAdaptersResponse(adapters=[self._status(e) for e in self.frontend.loaded_adapters()],
                                               active=self.frontend.active_adapter)

    async def GetModelInfo(self, request, context):
        info, model = self.frontend.describe(), self.frontend.model_info
        return common_pb2.ModelInfo(model_id=model["model_id"], base_model_sha256=model["sha256"],
                                    engine=str(info.get("engine", "")), device=str(info.get("device", "")),
                                    num_parameters=int(info.get("num_parameters", 0)),
                                    extra={k: str(v) for k, v in info.items()})
