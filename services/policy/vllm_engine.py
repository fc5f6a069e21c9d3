"""The generation engine on vLLM (GPU hosts): same protocol as TransformersEngine.

vllm is imported only when an engine is built, so CPU hosts never need it. Adapters are vLLM
LoRA requests; every load gets a fresh integer id, never reused, because vLLM caches LoRA
weights (and prefix-cache blocks) by id: reloading different weights under an old id would
serve the stale ones.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Sequence

from prorag.errors import InvalidArgument, NotFound, Unavailable

from prorag.engine import (GeneratedSeq, GenerationEngine, SamplingSpec, already_loaded, check_prompts, derive_seed,
                     validate_adapter_dir)


class VLLMEngine(GenerationEngine):
    """``vllm.LLM`` with LoRA enabled; prompts go in as token ids, logprobs of sampled tokens come back."""

    name = "vllm"

    def __init__(self, model_path: str | Path, max_loras: int = 2, max_lora_rank: int = 64,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = True, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, logprobs_mode: str | None = "raw_logprobs", **llm_kwargs):
        """max_loras >= 2 so the next adapter version loads while the current one still serves.

        logprobs_mode: "raw_logprobs" = log-softmax of the unprocessed logits (what RL needs);
        None leaves vLLM's default.
        """
        if max_loras < 2:
            raise InvalidArgument(f"max_loras must be >= 2 (old and new adapter versions coexist), got {max_loras}")
        import vllm
        from transformers import AutoTokenizer

        kwargs = dict(model=str(model_path), enable_lora=True, max_loras=int(max_loras),
                      max_lora_rank=int(max_lora_rank), gpu_memory_utilization=float(gpu_memory_utilization),
                      tensor_parallel_size=int(tensor_parallel_size), enable_prefix_caching=bool(enable_prefix_caching),
                      dtype=dtype, seed=int(seed))
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if logprobs_mode:
            kwargs["logprobs_mode"] = logprobs_mode
        kwargs.update(llm_kwargs)
        self._vllm = vllm
        self.model_path = str(model_path)
        self.settings = {k: v for k, v in kwargs.items() if k != "model"}
        self._llm = vllm.LLM(**kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self.vocab_size = len(self.tokenizer)
        self._adapters: dict[str, tuple[object, str]] = {}  # key -> (LoRARequest, resolved path)
        self._next_id = 1
        self._lock = threading.Lock()
        self.stats = {"generate_calls": 0, "generated_tokens": 0, "generate_s": 0.0}

    # -- adapters --

    def load_adapter(self, key: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not key:
            raise InvalidArgument("adapter key must be non-empty")
        p = str(validate_adapter_dir(path).resolve())
        with self._lock:
            if already_loaded(self._adapters, key, p):
                return
            req = LoRARequest(lora_name=key, lora_int_id=self._next_id, lora_path=p)
            self._next_id += 1  # ids are never reused, even after an unload
            add = getattr(self._llm.llm_engine, "add_lora", None)
            if add is not None:
                # load now so a broken adapter fails here, not inside a rollout
                add(req)
            self._adapters[key] = (req, p)

    def unload_adapter(self, key: str) -> None:
        with self._lock:
            if key not in self._adapters:
                raise NotFound(f"adapter {key!r} is not loaded")
            req, _ = self._adapters.pop(key)
            remove = getattr(self._llm.llm_engine, "remove_lora", None)
            if remove is not None:
                remove(req.lora_int_id)

    def adapters(self) -> list[str]:
        return list(self._adapters)

    def adapter_id(self, key: str) -> int:
        """The vLLM integer id behind ``key`` (for logs and tests)."""
        if key not in self._adapters:
            raise NotFound(f"adapter {key!r} is not loaded")
        return self._adapters[key][0].lora_int_id

    def info(self) -> dict:
        return {"engine": self.name, "model_path": self.model_path, "device": "cuda",
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size, "adapters": self.adapters(),
                **{k: v for k, v in self.settings.items() if isinstance(v, (int, float, str, bool))},
                **self.stats}

    # -- generation --

    def _sampling_params(self, params: SamplingSpec, seed: int):
        return self._vllm.SamplingParams(
            n=params.n, temperature=float(params.temperature), top_p=float(params.top_p),
            max_tokens=int(params.max_tokens), stop_token_ids=[int(t) for t in params.stop_token_ids],
            seed=int(seed) if seed else None, logprobs=0, skip_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec, adapter: str | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[GeneratedSeq]]:
        from vllm.inputs import TokensPrompt

        params.validate()
        check_prompts(prompts, self.vocab_size, self.max_model_len)
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidArgument(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        if seeds is None:
            # one SamplingParams for all: prompt i still gets its own stream when seeded
            per_prompt = [derive_seed(params.seed, i) for i in range(len(prompts))]
        else:
            per_prompt = [int(s) for s in seeds]
        sps = [self._sampling_params(params, s) for s in per_prompt]
        inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        t0 = time.perf_counter()
        with self._lock:
            if adapter is not None and adapter not in self._adapters:
                raise NotFound(f"adapter {adapter!r} is not loaded (loaded: {', '.join(self._adapters) or 'none'})")
            lora = self._adapters[adapter][0] if adapter is not None else None
            outputs = self._llm.generate(inputs, sampling_params=sps, lora_request=lora, use_tqdm=False)
        results = [self._convert(o, params) for o in outputs]
        self.stats["generate_calls"] += 1
        self.stats["generated_tokens"] += sum(len(s.token_ids) for r in results for s in r)
        self.stats["generate_s"] += time.perf_counter() - t0
        return results

    @staticmethod
    def _convert(request_output, params: SamplingSpec) -> list[GeneratedSeq]:
        """vLLM RequestOutput -> [n] GeneratedSeq (completions in index order)."""
        stops = set(int(t) for t in params.stop_token_ids)
        out = []
        for c in sorted(request_output.outputs, key=lambda c: c.index):
            ids = [int(t) for t in c.token_ids]
            lps = []
            for t, entry in zip(ids, c.logprobs or []):
                lp = entry.get(t) if entry else None
                lps.append(float(lp.logprob) if lp is not None else float("nan"))
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            if c.finish_reason not in ("stop", "length"):
                raise Unavailable(f"vLLM ended a completion with {c.finish_reason!r}")
            finish = c.finish_reason
            stop_id = None
            if finish == "stop":
                # stop_reason is the stop token id for stop_token_ids, None for EOS
                if isinstance(c.stop_reason, int):
                    stop_id = int(c.stop_reason)
                elif ids and (ids[-1] in stops or c.stop_reason is None):
                    stop_id = ids[-1]
            out.append(GeneratedSeq(token_ids=ids, logprobs=lps, finish_reason=finish, stop_token_id=stop_id))
        return out

    def close(self) -> None:
        self._llm = None


__all__ = ["VLLMEngine"]
