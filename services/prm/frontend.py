"""The PRM's request path: the checks a request must pass, then one batched engine call for concurrent callers
(prorag.rpc.batching: merged up to max_batch_steps, a queue bounded in steps refusing with RESOURCE_EXHAUSTED, a
deadline that cannot be met refused with DEADLINE_EXCEEDED).

It holds the engine served now: none until a PRM is loaded (the service is live but not ready, and says why),
swapped by the server when a newer PRM is published."""

from __future__ import annotations

from typing import Sequence

from prometheus_client import Counter, Info

from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.rpc.batching import MicroBatcher
from services.prm.engine import PRMEngine, ScoringItem

STEPS_SCORED = Counter("prorag_prm_steps_scored_total", "Steps the PRM scored")
MODEL_INFO = Info("prorag_prm_model", "The PRM served: its name@version ('' = none loaded, not ready)")


class ScoringFrontend:
    def __init__(self, engine: PRMEngine | None, max_items: int, max_steps: int, max_batch_steps: int = 1024,
                 max_queue_steps: int = 4096, max_queue: int = 1024, batch_wait_s: float = 0.002, workers: int = 1):
        self.engine, self.max_items, self.max_steps = engine, max_items, max_steps
        # weighed in steps: a request of one 64-step trajectory is not one of one 2-step trajectory; ``workers``
        # merged calls at once (PRMEngine.score is safe to call from several threads)
        self.batcher = MicroBatcher(lambda _key, items: self.engine.score(items), max_items=max_batch_steps,
                                    max_queue=max_queue, name="prm", concurrency=workers,
                                    weight=lambda items: sum(len(i.steps) for i in items),
                                    max_queue_weight=max_queue_steps, max_wait_s=batch_wait_s, what="steps")
        self.publish_version()

    def publish_version(self) -> None:
        """The served version into prorag_prm_model_info (at start, and after each hot swap)."""
        MODEL_INFO.info({"version": self.engine.version if self.engine is not None else ""})

    def loaded(self) -> PRMEngine:
        if self.engine is None:
            raise FailedPrecondition("no PRM is loaded: train one (trainer stage `prm`) and start the service with "
                                     "--set model=<directory or name[@version]>")
        return self.engine

    def check(self, items: Sequence[ScoringItem]) -> None:
        if not items:
            raise InvalidArgument("no trajectories to score")
        if len(items) > self.max_items:
            raise InvalidArgument(f"{len(items)} trajectories in one request; at most {self.max_items} "
                                  "(split the request)")
        for k, it in enumerate(items):
            if not it.question.strip():
                raise InvalidArgument(f"input {k}: empty question")
            if not it.steps:
                raise InvalidArgument(f"input {k}: no steps to score")
            if len(it.steps) > self.max_steps:
                raise InvalidArgument(f"input {k}: {len(it.steps)} steps; at most {self.max_steps}")
            for j, s in enumerate(it.steps):
                if s.empty:
                    raise InvalidArgument(f"input {k}, step {j}: empty step (no text and no content)")

    async def score(self, items: Sequence[ScoringItem], deadline: float | None) -> list[tuple[str, list[float]]]:
        """Per item: (the model version that scored it, one score per scored step)."""
        self.loaded()
        self.check(items)
        scored = await self.batcher.submit("prm", items, deadline)
        STEPS_SCORED.inc(sum(len(s) for _, s in scored))
        return scored

    async def close(self) -> None:
        await self.batcher.close()
