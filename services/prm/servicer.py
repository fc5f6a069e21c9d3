"""Thin gRPC servicer for prorag.v1.ProcessRewardModel: convert, call the front end (which checks, and batches
concurrent callers into one engine call)."""

from __future__ import annotations

import time

from prorag.pb import common_pb2, prm_pb2, prm_pb2_grpc
from prorag.rpc.pbconv import step_from_pb
from services.prm.engine import ScoringItem
from services.prm.frontend import ScoringFrontend


class PRMServicer(prm_pb2_grpc.ProcessRewardModelServicer):
    def __init__(self, frontend: ScoringFrontend):
        self.frontend = frontend

    async def ScoreSteps(self, request, context):
        items = [ScoringItem(i.question, [step_from_pb(s) for s in i.steps], i.last_step_only) for i in request.inputs]
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        scored = await self.frontend.score(items, deadline)
        # one engine call scored them all, under the engine's lock: one version
        return prm_pb2.ScoreStepsResponse(results=[prm_pb2.StepScores(scores=s) for _, s in scored],
                                          model_version=scored[0][0])

    async def GetModelInfo(self, request, context):
        e = self.frontend.loaded()
        return common_pb2.ModelInfo(model_id=e.version, engine="transformers", device=str(e.placement.device),
                                    num_parameters=sum(p.numel() for p in e.model.parameters()),
                                    extra={"max_context": str(e.max_len), "path": str(e.model_dir),
                                           "dtype": e.placement.dtype_name,
                                           "attn_implementation": e.placement.attn_implementation})
