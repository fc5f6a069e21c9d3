"""Policy service process: gRPC prorag.v1.Policy + OpenAI-compatible HTTP, one engine behind both."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prorag.pb import policy_pb2_grpc
from prorag.registry import artifact_name, weights_sha256
from prorag.rpc.grpc_server import ServerSpec
from prorag.rpc.service import ServeConfig, Started, start_grpc_and_http
from services.policy.config import PolicyConfig
from services.policy.frontend import PolicyFrontend
from services.policy.manager import AdapterManager
from services.policy.openai_http import make_app
from services.policy.retriever_client import RetrieverSearch
from services.policy.scheduler import GenerationScheduler
from services.policy.servicer import PolicyServicer

SERVICE = "prorag.v1.Policy"
log = logging.getLogger("prorag.policy")


def build_engine(cfg: PolicyConfig, model_path: Path):
    # each engine's module is imported only when chosen: vLLM's and torch's imports take seconds, and vLLM is
    # installed only where it serves
    if cfg.engine == "vllm":
        from services.policy.vllm_engine import VLLMEngine

        return VLLMEngine(str(model_path), dtype=cfg.vllm_dtype, max_model_len=cfg.max_model_len or None,
                          tensor_parallel_size=cfg.tensor_parallel_size,
                          gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enable_prefix_caching=cfg.enable_prefix_caching, enable_lora=cfg.enable_lora,
                          max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                          kv_cache_gb=cfg.vllm_kv_cache_gb,
                          logprobs_mode={"raw": "raw_logprobs", "tempered": "processed_logprobs"}[cfg.vllm_logprobs])
    from prorag.training.devices import resolve
    from services.policy.engine import TransformersEngine

    placement = resolve(cfg)  # a GPU or dtype this host lacks is refused here, at start
    return TransformersEngine(model_path, device=str(placement.device), dtype=placement.dtype,
                              max_batch_size=cfg.max_batch_size, merge_adapters=cfg.merge_adapters,
                              compile_decode=cfg.compile_decode)


async def start(serve: ServeConfig, cfg: PolicyConfig | None = None, engine=None) -> Started:
    cfg = cfg or PolicyConfig()
    model_path = cfg.resolved_model()
    owned = engine is None  # an engine built here is closed here (vLLM's engine core runs in processes of its own)
    engine = engine or build_engine(cfg, model_path)
    try:
        sha = weights_sha256(model_path)  # hashed once: it is the adapters' base identity and the served name's version
        model_info = {"model_id": str(model_path), "sha256": sha, "name": artifact_name(model_path, sha)}
        root = cfg.resolved_adapter_root()
        root.mkdir(parents=True, exist_ok=True)
        manager = AdapterManager(engine, root, str(model_path), model_info["sha256"])
        if cfg.restore_active:
            restored = await manager.restore_active()
            if restored is not None:
                log.info("restored the active adapter %s", restored)
        scheduler = GenerationScheduler(engine, max_items=cfg.max_batch_items)
        scheduler.bind(asyncio.get_running_loop())
        frontend = PolicyFrontend(engine, scheduler, manager, cfg,
                                  RetrieverSearch(cfg.retriever, cfg.retriever_timeout_s), model_info)
        servicer = PolicyServicer(frontend)
        spec = ServerSpec(name="policy",
                          services=[(SERVICE, lambda s: policy_pb2_grpc.add_PolicyServicer_to_server(servicer, s))])
        _, started = await start_grpc_and_http(serve, spec, lambda: make_app(frontend, model_name=model_info["name"]))
    except BaseException:
        if owned:  # a start that fails after the engine came up must not leave vLLM's processes behind
            await asyncio.to_thread(engine.close)
        raise

    async def close():
        await scheduler.close()
        frontend.close()
        if owned:
            await asyncio.to_thread(engine.close)

    started.stoppers.append(close)
    return started
