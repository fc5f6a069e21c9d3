"""PRM service process: batched step scoring (all steps of a trajectory in one pass, concurrent callers in one
engine call, bounded in steps), admission control (a bounded queue, deadlines honoured), the model version in every
response, and hot-swap of a newly published PRM."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from prorag.config import ConfigError, cfg_field
from prorag.errors import FailedPrecondition, NotFound
from prorag.registry import registry
from prorag.rpc.grpc_server import ServerSpec, start_server
from prorag.pb import prm_pb2_grpc
from prorag.rpc.service import ServeConfig, Started
from prorag.training.devices import DeviceConfig, check_device_config, resolve
from services.prm.engine import PRMEngine
from services.prm.frontend import ScoringFrontend
from services.prm.servicer import PRMServicer

SERVICE = "prorag.v1.ProcessRewardModel"
log = logging.getLogger("prorag.prm")


@dataclass
class PRMServeConfig(DeviceConfig):
    """Which PRM is served, where (device, dtype, attention kernel: prorag.training.devices), and the limits callers
    get."""

    model: str = cfg_field("", help="required: a PRM directory, or name[@version] in the world's PRM registry "
                                    "(a bare name serves its newest version)")
    world: str = cfg_field("default", help="world whose PRM registry `model` is looked up in")
    follow_latest_s: float = cfg_field(0.0, help="with a bare name: seconds between checks for a newer published "
                                                 "version, hot-swapped in when found (0 = never)", min=0.0)
    max_len: int = cfg_field(0, help="longest scored input in tokens (0 = the model's context)", min=0)
    max_items: int = cfg_field(512, help="most trajectories in one request", min=1, max=100000)
    max_steps: int = cfg_field(64, help="most steps in one trajectory", min=1, max=10000)
    max_batch_tokens: int = cfg_field(32768, help="tokens per forward pass when merged requests are scored, padding "
                                                  "included (rows are sorted by length first)", min=256)
    max_batch_padding: float = cfg_field(0.0, help="most padded tokens per real token in one forward pass, so rows of "
                                                   "different lengths run in separate passes; 0 = 1.0 on a CPU (where "
                                                   "a padded batch scored fewer steps per second than rows one at a "
                                                   "time), no bound on a GPU", min=0.0)
    max_batch_steps: int = cfg_field(1024, help="most steps of concurrent callers merged into one engine call (run as "
                                                "forward passes of max_batch_tokens); a larger request runs alone",
                                     min=1)
    max_queue_steps: int = cfg_field(4096, help="most steps waiting for the engine; past it a caller is refused with "
                                                "RESOURCE_EXHAUSTED at once (retry with backoff) instead of queueing "
                                                "behind a wait that only grows. A request reaching an empty queue is "
                                                "always taken", min=1)
    max_queue_requests: int = cfg_field(1024, help="most requests waiting for the engine (RESOURCE_EXHAUSTED past it)",
                                        min=1)
    engine_workers: int = cfg_field(0, help="engine calls run at once, each on an equal share of the process's torch "
                                            "threads. On a CPU one call keeps its threads busy only part of the "
                                            "time (1.3-1.45 of 2 cores measured): with callers waiting, a second "
                                            "call fills the rest. 0 = one per CPU thread up to 4 on a CPU, 1 on a "
                                            "GPU (one device, batched by the merged call); an engine handed to "
                                            "start() runs 1 unless set", min=0, max=64)
    batch_wait_ms: float = cfg_field(2.0, help="while callers overlap (the last engine call merged several), wait up "
                                               "to this long for more requests before an engine call below "
                                               "max_batch_steps; a lone caller never waits (0 = never)",
                                     min=0.0, max=1000.0)

    def validate(self) -> None:
        super().validate()
        if 0.0 < self.max_batch_padding < 1.0:
            raise ConfigError("max_batch_padding", f"{self.max_batch_padding:g}: padded tokens are at least the real "
                                                   "ones; give 1.0 or more, or 0 for the device's default")


def resolve_model(cfg: PRMServeConfig):
    if not cfg.model:
        raise FailedPrecondition("the PRM service needs `model`: a PRM directory or a published name[@version]")
    return registry("prm", cfg.world).resolve(cfg.model)


def engine_workers(cfg: PRMServeConfig, device: str) -> tuple[int, int]:
    """(engine calls at once, torch threads each) for ``device``: cfg.engine_workers, or its default, sharing the
    process's torch threads (OMP_NUM_THREADS, or the cores)."""
    import torch  # here, as the engine's import below: the config module is read without torch (prorag serve --help)

    threads = torch.get_num_threads()
    workers = cfg.engine_workers or (1 if torch.device(device).type != "cpu" else max(1, min(threads, 4)))
    return workers, max(1, threads // workers)


def _make_engine(cfg: PRMServeConfig, path):
    return PRMEngine(path, max_len=cfg.max_len, max_batch_tokens=cfg.max_batch_tokens, placement=resolve(cfg),
                     max_batch_padding=cfg.max_batch_padding)


async def _follow(cfg: PRMServeConfig, frontend: ScoringFrontend, running) -> None:
    """Swap in each newly published version; with none published yet, become ready at the first publish."""
    while True:
        await asyncio.sleep(cfg.follow_latest_s)
        engine = frontend.engine
        try:
            path = await asyncio.to_thread(resolve_model, cfg)
            if engine is None:
                frontend.engine = await asyncio.to_thread(_make_engine, cfg, path)
                frontend.publish_version()
                await running.set_ready(SERVICE, True)
                log.info("the first PRM was published: serving %s", frontend.engine.version)
            elif path != engine.model_dir:
                version = await asyncio.to_thread(engine.load, path)
                frontend.publish_version()
                log.info("hot-swapped the PRM to %s", version)
        except NotFound:
            if engine is not None:
                log.error("%s is no longer in the registry; still serving %s", cfg.model, engine.version)
        except Exception:  # noqa: BLE001 - a bad publish must not stop serving the current model
            log.exception("checking for a newer PRM failed; still serving %s",
                          engine.version if engine is not None else "nothing")


async def start(serve: ServeConfig, cfg: PRMServeConfig | None = None, engine=None) -> Started:
    cfg = cfg or PRMServeConfig()
    check_device_config(cfg)  # a GPU or dtype this host lacks is refused at start, not at the first request
    following = bool(cfg.follow_latest_s) and "@" not in cfg.model and not Path(cfg.model).is_dir()
    engine_given = engine is not None
    if engine is None and cfg.model:
        try:
            engine = _make_engine(cfg, resolve_model(cfg))
        except NotFound:
            if not following:
                raise
            # named before it is trained (a deployment started ahead of stage 2): ready at the first publish
            log.warning("no PRM %r published yet in world %r; not ready until one is", cfg.model, cfg.world)
    if engine_given:  # an engine handed in (a test, a program embedding the service): its threads are the caller's
        workers = cfg.engine_workers or 1
    else:
        workers, threads = engine_workers(cfg, resolve(cfg).device)
        if workers > 1:  # each call's ops on its own threads: the calls share the cores, not oversubscribe them
            import torch  # torch only where the service starts an engine (see engine_workers)

            torch.set_num_threads(threads)
        log.info("PRM engine: %d call(s) at once, %d torch thread(s) each", workers, threads)
    # without a model (a stack started before any PRM is trained) it is live but not ready, and says why
    frontend = ScoringFrontend(engine, cfg.max_items, cfg.max_steps, max_batch_steps=cfg.max_batch_steps,
                               max_queue_steps=cfg.max_queue_steps, max_queue=cfg.max_queue_requests,
                               batch_wait_s=cfg.batch_wait_ms / 1e3, workers=workers)
    servicer = PRMServicer(frontend)
    spec = ServerSpec(name="prm",
                      services=[(SERVICE,
                                 lambda s: prm_pb2_grpc.add_ProcessRewardModelServicer_to_server(servicer, s))],
                      ready={SERVICE: engine is not None})
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb, serve.max_concurrent_rpcs,
                                 security=serve.security())
    stoppers = [lambda: running.stop(serve.grace_s), frontend.close]
    if following:
        task = asyncio.get_running_loop().create_task(_follow(cfg, frontend, running))

        async def stop_follow():
            task.cancel()
        stoppers.insert(0, stop_follow)
    return Started("prm", running.port, None, stoppers)
