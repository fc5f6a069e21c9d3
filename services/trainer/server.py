"""trainer service process: persistent training jobs (StartJob / WatchJob / CancelJob / GetJob / ListJobs).

Jobs live under ``<PRORAG_HOME>/runs/jobs`` and survive restarts: a job a killed trainer
left running is re-queued at the next start and resumes from its last checkpoint. The
service reports NOT_SERVING until the job store is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prorag import paths
from prorag.config import cfg_field
from prorag.rpc.grpc_server import ServerSpec, start_server
from prorag.pb import trainer_pb2_grpc
from prorag.validation import DEFAULT_ALLOWED_ENDPOINTS
from prorag.rpc.service import ServeConfig, Started
from services.trainer.jobs import JobManager, JobState
from services.trainer.servicer import TrainerServicer
from services.trainer.stages import load_stage_modules

SERVICE = "prorag.v1.Trainer"
log = logging.getLogger("prorag.trainer")


class JobStates(Collector):
    """prorag_trainer_jobs{state}: jobs per state in the running trainers' stores, counted at each scrape (so it
    is never stale, and there is no counter to keep in step with every state change)."""

    def __init__(self) -> None:
        self.managers: list[JobManager] = []

    def collect(self):
        family = GaugeMetricFamily("prorag_trainer_jobs", "Trainer jobs by state", labels=["state"])
        totals: dict[JobState, int] = {}
        for manager in list(self.managers):
            for state, n in manager.state_counts().items():
                totals[state] = totals.get(state, 0) + n
        for state in JobState:
            family.add_metric([state.value], totals.get(state, 0))
        yield family


JOB_STATES = JobStates()
REGISTRY.register(JOB_STATES)


@dataclass
class TrainerConfig:
    jobs_root: str = cfg_field("", help="where jobs live; '' = <PRORAG_HOME>/runs/jobs (PRORAG_RUNS moves runs/)")
    keep_checkpoints: int = cfg_field(2, help="checkpoints kept per job (older ones are deleted)", min=1, max=1000)
    tracking: str = cfg_field("", help="default tracking for stages that do not choose: 'wandb' (offline unless "
                                       "WANDB_API_KEY is set) or 'local' (metrics.jsonl only); '' = $PRORAG_TRACKING "
                                       "or 'wandb'", choices=("", "wandb", "local"))
    stage_modules: list[str] = cfg_field(help="extra modules that register stages on import "
                                              "(services.trainer.stage_* are always loaded)", factory=list)
    parallel_jobs: int = cfg_field(1, help="jobs run side by side (FIFO); on CPU give each job threads = cores / "
                                          "parallel_jobs (small models gain little from a second thread per job)",
                                   min=1, max=64)
    stop_timeout_s: float = cfg_field(30.0, help="seconds the running stage gets to checkpoint at shutdown", min=0)
    allowed_endpoints: list[str] = cfg_field(
        help="where a job config may point the trainer (retriever, policy, judge, prm, openai_base_url): host "
             "patterns with * wildcards (prorag-*), IPs or networks (127.0.0.0/8), each optionally with :port "
             "(judge.internal:50054); a job naming any other endpoint is refused at StartJob (INVALID_ARGUMENT). "
             "The default is loopback and the compose/k8s service names",
        factory=lambda: list(DEFAULT_ALLOWED_ENDPOINTS))
    service_addresses: dict[str, str] = cfg_field(
        help="addresses a job config gets for the fields it leaves unset, e.g. {\"retriever\": \"retriever:50051\", "
             "\"policy\": \"dns:///prorag-policy-headless:50052\"} in containers, where the stages' 127.0.0.1 "
             "defaults reach nothing; only fields the stage has are filled", factory=dict)
    max_queued_jobs: int = cfg_field(256, help="jobs waiting to run at most; StartJob beyond it is refused with "
                                               "RESOURCE_EXHAUSTED", min=1, max=1_000_000)
    max_attempts: int = cfg_field(3, help="times a job's process may die under it (killed, out of memory, a crash) "
                                         "before the job is FAILED instead of re-queued at the next start; a clean "
                                         "shutdown does not count", min=1, max=1000)
    memory_check: bool = cfg_field(True, help="refuse at StartJob (FAILED_PRECONDITION) a training job whose memory "
                                              "estimate (weights, gradients, optimizer state, activations and logits "
                                              "at its micro-batch of max_len sequences: a worst case) exceeds the GPU "
                                              "it would run on, naming the launch that would fit; false = submit "
                                              "anyway (services/trainer/memory_check.py)")

    def resolved_root(self) -> Path:
        return Path(self.jobs_root) if self.jobs_root else paths.runs_dir() / "jobs"

    def resolved_tracking(self) -> str:
        mode = self.tracking or os.environ.get("PRORAG_TRACKING", "") or "wandb"
        if mode not in ("wandb", "local"):
            raise ValueError(f"PRORAG_TRACKING must be 'wandb' or 'local', got {mode!r}")
        return mode


async def start(serve: ServeConfig, cfg: TrainerConfig | None = None, **_: object) -> Started:
    cfg = cfg or TrainerConfig()
    load_stage_modules(cfg.stage_modules)
    manager = JobManager(cfg.resolved_root(), keep_checkpoints=cfg.keep_checkpoints,
                         tracking=cfg.resolved_tracking(), parallel_jobs=cfg.parallel_jobs,
                         max_attempts=cfg.max_attempts, allowed_endpoints=cfg.allowed_endpoints,
                         service_addresses=cfg.service_addresses, max_queued_jobs=cfg.max_queued_jobs,
                         memory_check=cfg.memory_check)
    servicer = TrainerServicer(manager)
    spec = ServerSpec(name="trainer",
                      services=[(SERVICE, lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s))],
                      ready={SERVICE: False})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb, serve.max_concurrent_rpcs,
                                 security=serve.security())
    try:
        await asyncio.to_thread(manager.load)
    except BaseException:
        await running.stop(0)
        raise
    manager.start()
    JOB_STATES.managers.append(manager)
    await running.set_ready(SERVICE, True)

    async def stop() -> None:
        servicer.close()
        await running.set_ready(SERVICE, False)
        # The stage checkpoints before the process exits, so the job resumes on restart.
        await asyncio.to_thread(manager.stop, cfg.stop_timeout_s)
        await running.stop(serve.grace_s)
        if manager in JOB_STATES.managers:
            JOB_STATES.managers.remove(manager)

    started = Started("trainer", running.port, None, [stop])
    started.manager = manager  # type: ignore[attr-defined]  # for in-process callers and tests
    return started
