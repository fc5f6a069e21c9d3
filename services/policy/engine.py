"""The transformers generation engine (CPU or GPU); the interface is prorag.engine, vLLM is beside it.

Prompts and outputs are token ids: the rollout loop carries ids across turns and never
re-encodes text. Every generated token comes with its raw log-prob (log-softmax of the model's
logits at temperature 1, before top-p), which is what the RL loss needs and what vLLM returns
by default.

The engine holds the lock and the request's bookkeeping; the rest is apart by concern: batched decoding
(batch_decoding), the prefix KV cache (prefix_cache), compiled decoding (compiled_decode), LoRA adapters
(adapter_weights) and token sampling (sampling).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from prorag.engine import (GeneratedSeq, GenerationEngine, SamplingSpec, check_generate, derive_seed,
                           validate_adapter_dir)
from prorag.errors import InvalidArgument, NotFound
from prorag.modeling import load_policy, num_parameters
from services.policy.adapter_weights import AdapterWeights
from services.policy.batch_decoding import BatchDecoder, Row
from services.policy.compiled_decode import CompiledSteps
from services.policy.prefix_cache import CachedPrefix, PrefixKVCache

log = logging.getLogger("prorag.policy.engine")


class TransformersEngine(GenerationEngine):
    """Batched KV-cache decoding with transformers; LoRA adapters through PEFT.

    One lock serialises generation and adapter changes, so a batch always finishes on the
    weights it started with. Identical prompts in a call are prefilled once, and the KV of
    finished sequences is kept (up to ``prefix_cache_bytes``) so a later prompt that extends
    one (the next round of a rollout) prefills only its new tokens.
    """

    name = "transformers"

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                 max_batch_size: int = 256, max_model_len: int | None = None, cache: str = "static",
                 compact_below: float = 0.75, prefix_cache_bytes: int = 1 << 30, num_threads: int | None = None,
                 model=None, tokenizer=None, merge_adapters: bool = True, compile_decode: str = "auto",
                 compile_backend: str = "inductor", stop_check_every: int = 8):
        """model_path: any HF causal LM directory; ``model``/``tokenizer`` may be passed pre-loaded.

        cache: "static" (preallocated per chunk, no per-token copies) or "dynamic".
        compact_below: drop finished rows from the batch once the live fraction falls below this.
        prefix_cache_bytes: memory for reusable KV of finished sequences; 0 turns reuse off.
        num_threads: torch CPU threads for this process (None leaves torch's default). On shared
          cores also start the process with OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads
          slow small-model decoding 5-10x when another process competes for the cores.
        merge_adapters: run each loaded adapter as its own copy of the base with the LoRA weights merged in
          (one model copy of memory per adapter) instead of PEFT's LoRA layers around the shared base: every
          projection is then one matmul, not three plus PEFT's per-layer Python, which on a CPU is much of a
          small model's decoding time.
        compile_decode: "on" runs the one-token decode step through torch.compile, with CUDA graphs on a GPU
          (mode "reduce-overhead"), over a static cache whose memory is kept between chunks; "auto" = on for CUDA
          devices only (on a CPU the eager loop is as fast for small models, and compiling costs seconds); "off".
          Prefill stays eager. Any compile failure is logged and that model decodes uncompiled from then on.
        compile_backend: torch.compile's backend for compile_decode (tests use "aot_eager" to skip codegen).
        stop_check_every: with compile_decode, finished rows are read back every this many steps, not every token
          (each read waits for the GPU); a row that stopped in between decodes a few tokens that are dropped.
        """
        if max_batch_size < 1:
            raise InvalidArgument(f"max_batch_size must be >= 1, got {max_batch_size}")
        if cache not in ("static", "dynamic"):
            raise InvalidArgument(f"cache must be 'static' or 'dynamic', got {cache!r}")
        if compile_decode not in ("auto", "on", "off"):
            raise InvalidArgument(f"compile_decode must be 'auto', 'on' or 'off', got {compile_decode!r}")
        if stop_check_every < 1:
            raise InvalidArgument(f"stop_check_every must be >= 1, got {stop_check_every}")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.model_path = str(model_path)
        self.device = torch.device(device)
        if model is None or tokenizer is None:
            model, tokenizer = load_policy(model_path, device=device, dtype=dtype)
        self.weights = AdapterWeights(model.to(self.device).eval(), merge_adapters)
        self.tokenizer = tokenizer
        self.merge_adapters = bool(merge_adapters)
        self._lock = threading.Lock()
        self.max_batch_size = int(max_batch_size)
        cfg_len = int(getattr(self.base.config, "max_position_embeddings", 0) or 1 << 30)
        self.max_model_len = min(cfg_len, int(max_model_len)) if max_model_len else cfg_len
        self.cache = cache
        self.compact_below = float(compact_below)
        self.prefix_cache = PrefixKVCache(prefix_cache_bytes)
        self.vocab_size = int(self.base.get_output_embeddings().weight.shape[0])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.stats = {"generate_calls": 0, "generated_tokens": 0, "generate_s": 0.0,
                      "prefill_tokens": 0, "reused_tokens": 0, "compiled_steps": 0}
        self.compile_decode = compile_decode == "on" or (compile_decode == "auto" and self.device.type == "cuda")
        if self.compile_decode and cache != "static":
            log.warning("compile_decode needs cache='static' (a dynamic cache changes shape every token): "
                        "decoding uncompiled")
            self.compile_decode = False
        self.compile_backend = compile_backend
        self.stop_check_every = int(stop_check_every)
        self.compiled = CompiledSteps(self.device, compile_backend, self.stats)
        self.decoder = BatchDecoder(device=self.device, pad_id=self.pad_id, cache=cache,
                                    compact_below=self.compact_below, max_batch_size=self.max_batch_size,
                                    stop_check_every=self.stop_check_every, prefix_cache=self.prefix_cache,
                                    stats=self.stats, compiled=self.compiled if self.compile_decode else None)

    @property
    def base(self) -> torch.nn.Module:
        """The base model (PEFT's LoRA layers sit inside it while adapters are loaded unmerged)."""
        return self.weights.base

    # -- adapters --

    def load_adapter(self, key: str, path: str) -> None:
        if not key:
            raise InvalidArgument("adapter key must be non-empty")
        resolved = str(validate_adapter_dir(path).resolve())
        with self._lock:
            if self.weights.load(key, resolved, shown_path=path):
                self.prefix_cache.drop_adapter(key)  # a reload under this key may hold other weights

    def unload_adapter(self, key: str) -> None:
        with self._lock:
            self.weights.unload(key)
            self.prefix_cache.drop_adapter(key)  # a later load under this key may hold other weights
            self.compiled.keep_only(self.weights.served())

    def adapters(self) -> list[str]:
        return self.weights.keys()

    def info(self) -> dict:
        return {"engine": self.name, "model_path": self.model_path, "device": str(self.device),
                "dtype": str(next(self.base.parameters()).dtype).replace("torch.", ""),
                "num_parameters": num_parameters(self.base), "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "max_batch_size": self.max_batch_size,
                "adapters": self.adapters(), "prefix_cache_entries": len(self.prefix_cache),
                "prefix_cache_bytes": self.prefix_cache.bytes, "compile_decode": self.compile_decode,
                "decode_cache_bytes": self.compiled.kv_pool.nbytes, **self.stats}

    # -- generation --

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec, adapter: str | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[GeneratedSeq]]:
        check_generate(prompts, params, seeds, self.vocab_size, self.max_model_len)
        stops = set(int(t) for t in params.stop_token_ids)
        if self.eos_id is not None:
            stops.add(int(self.eos_id))  # like vLLM: EOS always ends a sequence
        rows: list[Row] = []
        for i, p in enumerate(prompts):
            # prompt i's stream: its own seed, else one derived from params.seed (as VLLMEngine does)
            prompt_seed = derive_seed(params.seed, i) if seeds is None else int(seeds[i])
            for j in range(params.n):
                s = derive_seed(prompt_seed, j)
                g = torch.Generator().manual_seed(s) if s else None
                rows.append(Row(prompt=[int(t) for t in p], generator=g,
                                 max_new=min(params.max_tokens, self.max_model_len - len(p))))
        t0 = time.perf_counter()
        with self._lock:
            if adapter is not None and adapter not in self.weights:
                loaded = ", ".join(self.weights.keys()) or "none"
                raise NotFound(f"adapter {adapter!r} is not loaded (loaded: {loaded})")
            found: dict[tuple, CachedPrefix | None] = {}
            for r in rows:
                key = tuple(r.prompt)
                if key not in found:  # at least one token is always prefilled: it yields the first logits
                    found[key] = self.prefix_cache.longest_prefix(adapter, r.prompt, len(r.prompt) - 1)
                r.reuse = found[key]
            # rows with similar numbers of new tokens share a chunk (the prefill pads to the largest);
            # identical prompts stay adjacent so a chunk prefills each once
            order = sorted(range(len(rows)), key=lambda k: (
                len(rows[k].prompt) - (len(rows[k].reuse.ids) if rows[k].reuse else 0), rows[k].prompt))
            model = self.weights.model_for(adapter)
            with self.weights.context(adapter), torch.inference_mode():
                for c in range(0, len(order), self.max_batch_size):
                    self.decoder.decode(model, [rows[k] for k in order[c:c + self.max_batch_size]], params, stops,
                                        adapter)
        for r in rows:
            r.reuse = None
        self.stats["generate_calls"] += 1
        self.stats["generated_tokens"] += sum(len(r.out) for r in rows)
        self.stats["generate_s"] += time.perf_counter() - t0
        seqs = [GeneratedSeq(r.out, r.logprobs, r.finish, r.stop) for r in rows]
        return [seqs[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]


__all__ = ["TransformersEngine"]
