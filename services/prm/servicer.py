"""Thin gRPC servicer for prorag.v1.ProcessRewardModel: validate, convert, score through the micro-batcher (so
concurrent callers share one engine call)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Info

from prorag.rpc.batching import MicroBatcher
from prorag.errors import FailedPrecondition
from prorag.pb import common_pb2, prm_pb2, prm_pb2_grpc
from prorag.rpc.pbconv import step_from_pb
from services.prm.engine import ScoringItem, validate_items


STEPS_SCORED = Counter("prorag_prm_steps_scored_total", "Steps the PRM scored")
MODEL_INFO = Info("prorag_prm_model", "The PRM served: its name@version ('' = none loaded, not ready)")


class PRMServicer(prm_pb2_grpc.ProcessRewardModelServicer):
    def __init__(self, engine, max_items: int, max_steps: int, max_batch_items: int = 256, max_queue: int = 1024):
        self.engine, self.max_items, self.max_steps = engine, max_items, max_steps
        self.batcher = MicroBatcher(lambda _key, items: self.engine.score(items), max_items=max_batch_items,
                                    max_queue=max_queue, name="prm")
        self.publish_version()

    def publish_version(self) -> None:
        """The served version into prorag_prm_model_info (at start, and after each hot swap)."""
        MODEL_INFO.info({"version": self.engine.version if self.engine is not None else ""})

    def _engine(self):
        if self.engine is None:
            raise FailedPrecondition("no PRM is loaded: train one (trainer stage `prm`) and start the service with "
                                     "--set model=<directory or name[@version]>")
        return self.engine

    async def ScoreSteps(self, request, context):
        self._engine()
        items = [ScoringItem(i.question, [step_from_pb(s) for s in i.steps], i.last_step_only) for i in request.inputs]
        validate_items(items, self.max_items, self.max_steps)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        scored = await self.batcher.submit("prm", items, deadline)
        STEPS_SCORED.inc(sum(len(s) for _, s in scored))
        # one engine call scored them all, under the engine's lock: one version
        return prm_pb2.ScoreStepsResponse(results=[prm_pb2.StepScores(scores=s) for _, s in scored],
                                          model_version=scored[0][0])

    async def GetModelInfo(self, request, context):
        e = self._engine()
        return common_pb2.ModelInfo(model_id=e.version, engine="transformers", device=str(e.placement.device),
                                    num_parameters=sum(p.numel() for p in e.model.parameters()),
                                    extra={"max_context": str(e.max_len), "path": str(e.model_dir),
                                           "dtype": e.placement.dtype_name,
                                           "attn_implementation": e.placement.attn_implementation})

    async def close(self) -> None:
        await self.batcher.close()
