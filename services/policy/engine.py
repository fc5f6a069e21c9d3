"""The transformers generation engine (CPU or GPU); the interface is prorag.engine, vLLM is beside it.

Prompts and outputs are token ids: the rollout loop carries ids across turns and never
re-encodes text. Every generated token comes with its raw log-prob (log-softmax of the model's
logits at temperature 1, before top-p), which is what the RL loss needs and what vLLM returns
by default.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from prorag.engine import (ADAPTER_FILES, GeneratedSeq, GenerationEngine, SamplingSpec, already_loaded, check_prompts,
                           derive_seed, validate_adapter_dir)
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger("prorag.policy.engine")

# --- sampling (pure) -------------------------------------------------------------------------

def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the smallest set whose probability reaches ``top_p``.

    logits: [B, V] -> [B, V]; the most likely token always survives.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token
    drop_sorted = before >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
    """Next token per row. logits: [B, V] float32 -> [B] int64.

    temperature 0 = argmax. ``generators`` (one per row, or None) make each row's draw
    independent of the rest of the batch, so a seeded sample does not depend on its batch-mates.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(top_p_filter(logits / temperature, top_p), dim=-1)
    B = probs.shape[0]
    # inverse-CDF sampling: one uniform per row, drawn from that row's own generator
    # (a per-row multinomial call costs ~50x more at an 8k vocabulary)
    if not generators or all(g is None for g in generators):
        u = torch.rand(B)
    else:
        u = torch.cat([torch.rand(1, generator=g) if g is not None else torch.rand(1) for g in generators])
    # non_blocking: a blocking host-to-GPU copy would wait for the queued decode step every token
    u = (1.0 - u).to(probs.device, non_blocking=True)  # in (0, 1]: never lands on a leading zero-probability token
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


# --- prefix KV cache -------------------------------------------------------------------------

_HASH_BASE = 0x9E3779B97F4A7C15


def prefix_hashes(ids: Sequence[int]) -> np.ndarray:
    """[n] ids -> [n] uint64: entry i hashes ids[:i+1] (polynomial, wrapping mod 2**64).

    >>> h = prefix_hashes([5, 6, 7]); bool(h[1] == prefix_hashes([5, 6])[1])
    True
    """
    a = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    powers = np.cumprod(np.full(len(a), _HASH_BASE, dtype=np.uint64))
    return np.cumsum(a * powers, dtype=np.uint64)


@dataclass
class _Entry:
    ids: tuple[int, ...]
    keys: list[torch.Tensor]    # per layer [kv_heads, len, head_dim]
    values: list[torch.Tensor]
    nbytes: int


class PrefixKVCache:
    """LRU of per-sequence KV states, keyed by (adapter, token prefix).

    A rollout's next prompt is its previous prompt + step + inserted glue, so the KV of
    everything but the glue can be reused instead of prefilled again (vLLM's prefix caching,
    reduced to what a CPU engine needs). Entries of an adapter are dropped when it unloads.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._entries: "OrderedDict[tuple, _Entry]" = OrderedDict()
        self._lengths: dict[str | None, dict[int, int]] = {}  # adapter -> length -> entry count

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, adapter: str | None, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]):
        nbytes = sum(k.numel() * k.element_size() for k in keys) * 2
        if self.max_bytes <= 0 or nbytes > self.max_bytes or not ids:
            return
        key = (adapter, len(ids), int(prefix_hashes(ids)[-1]))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = _Entry(tuple(ids), keys, values, nbytes)
        self.bytes += nbytes
        counts = self._lengths.setdefault(adapter, {})
        counts[len(ids)] = counts.get(len(ids), 0) + 1
        while self.bytes > self.max_bytes:
            self._pop(next(iter(self._entries)))

    def _pop(self, key) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.nbytes
        counts = self._lengths[key[0]]
        counts[key[1]] -= 1
        if not counts[key[1]]:
            del counts[key[1]]

    def longest_prefix(self, adapter: str | None, ids: Sequence[int], max_len: int) -> _Entry | None:
        """The longest cached proper prefix of ``ids`` of at most ``max_len`` tokens."""
        counts = self._lengths.get(adapter)
        if not counts or max_len <= 0:
            return None
        h = None
        for n in sorted((n for n in counts if n <= max_len), reverse=True):
            if h is None:
                h = prefix_hashes(ids[:max_len])
            key = (adapter, n, int(h[n - 1]))
            e = self._entries.get(key)
            if e is not None and e.ids == tuple(ids[:n]):
                self._entries.move_to_end(key)
                return e
        return None

    def drop_adapter(self, adapter: str | None) -> None:
        for key in [k for k in self._entries if k[0] == adapter]:
            self._pop(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._pop(key)


# --- compiled decoding (CUDA graphs over a static KV cache) ------------------------------------

#: the static cache's length is rounded up to a multiple of this, so chunks of similar lengths replay one graph
CACHE_LEN_STEP = 128


def batch_bucket(n: int, cap: int) -> int:
    """The batch size a chunk of ``n`` live rows is padded to: the next power of two, or ``cap`` (>= n) when smaller.

    A CUDA graph replays one shape only; a few buckets keep the number of recorded graphs small.

    >>> [batch_bucket(n, 48) for n in (1, 3, 4, 17, 40, 48)]
    [1, 4, 4, 32, 48, 48]
    """
    return min(1 << (max(1, n) - 1).bit_length(), max(n, cap))


class _KVPool:
    """Per-layer key/value storage that outlives a chunk's cache, so compiled graphs see the same addresses.

    CUDA graphs (and torch.compile's static inputs) bake in tensor addresses: a new cache per chunk would make
    every chunk record its graph again, and those recordings pile up. Each layer owns one flat buffer, grown
    (never shrunk) to the largest chunk seen; a chunk's [B, H, L, D] cache is a contiguous view of its front.
    """

    def __init__(self):
        self._flat: dict[tuple[int, str], torch.Tensor] = {}
        self._lengths: dict[int, torch.Tensor] = {}

    def view(self, layer: int, kind: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        need = int(np.prod(shape))
        flat = self._flat.get((layer, kind))
        if flat is None or flat.numel() < need or flat.dtype != like.dtype or flat.device != like.device:
            self._flat.pop((layer, kind), None)
            flat = None  # the old buffer goes before the larger one is allocated
            # zeros, not empty: masked columns still enter attention's probs @ V, where 0 * NaN bits is NaN
            flat = self._flat[(layer, kind)] = torch.zeros(need, dtype=like.dtype, device=like.device)
        return flat[:need].view(shape)

    def length(self, layer: int, device: torch.device) -> torch.Tensor:
        """The layer's write position (StaticLayer.cumulative_length): a 0-d tensor that also keeps its address."""
        t = self._lengths.get(layer)
        if t is None or t.device != device:
            self._lengths[layer] = t = torch.zeros((), dtype=torch.long, device=device)
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())


def _pooled_static_cache(model, max_cache_len: int, pool: _KVPool):
    """A transformers StaticCache whose layers keep their tensors in ``pool`` (plain full-attention models only:
    the engine checks the layer types before it compiles)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    layer_cls = _pooled_layer_class()
    cache.layers = [layer_cls(max_cache_len, pool, i) for i in range(len(cache.layers))]
    return cache


#: transformers' sdpa attention, with one-token queries on grouped KV heads run without copies of K and V
GQA_DECODE_ATTENTION = "prorag_sdpa_gqa_decode"


def _sdpa_gqa_decode(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except for a one-token query on grouped KV heads (GQA): the query heads of a
    group become the query length, so SDPA reads each KV head once. Under torch.compile transformers instead repeats
    K and V to every query head (repeat_kv, as SDPA's own GQA takes no mask on CUDA), which writes and reads the
    whole cache several times over in a step that is bound by reading it once. Eager transformers does the same
    packing for one-token queries (its pack_gqa, from 5.2x on), only not under compile."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or query.shape[2] != 1 or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or (attention_mask is not None and attention_mask.shape[1] != 1))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // groups, groups, D), key, value, attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _use_gqa_decode_attention(model) -> None:
    """Switch an sdpa model with grouped KV heads to GQA_DECODE_ATTENTION (its masks stay sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config
    if cfg._attn_implementation != "sdpa" or (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) \
            == cfg.num_attention_heads:
        return
    AttentionInterface.register(GQA_DECODE_ATTENTION, _sdpa_gqa_decode)
    AttentionMaskInterface.register(GQA_DECODE_ATTENTION, sdpa_mask)
    try:
        model.set_attn_implementation(GQA_DECODE_ATTENTION)
    except (ValueError, AttributeError, NotImplementedError) as e:  # a model that cannot switch keeps plain sdpa
        log.warning("compile_decode: %s keeps sdpa attention (repeated KV heads under compile): %s",
                    type(model).__name__, e)


@functools.cache
def _pooled_layer_class():
    from transformers.cache_utils import StaticLayer

    class PooledLayer(StaticLayer):
        """StaticLayer allocating from a _KVPool (its documented hook: lazy_initialization); rebatch moves rows."""

        _layer_type = None  # never registered as the default static layer

        def __init__(self, max_cache_len: int, pool: _KVPool, index: int):
            super().__init__(max_cache_len=max_cache_len)
            self.pool, self.index = pool, index

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.num_heads = key_states.shape[1]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            self._like = (key_states, value_states)
            self.cumulative_length = self.pool.length(self.index, self.device)
            self.cumulative_length.zero_()
            self._bind(key_states.shape[0])
            self.is_initialized = True

        def _bind(self, batch: int) -> None:
            self.batch_size = batch
            k, v = self._like
            shape = (batch, self.num_heads, self.max_cache_len)
            self.keys = self.pool.view(self.index, "k", (*shape, self.k_head_dim), k)
            self.values = self.pool.view(self.index, "v", (*shape, self.v_head_dim), v)
            for t in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(t)

        def rebatch(self, idx: torch.Tensor) -> None:
            """Rows ``idx`` of the current batch become the new batch (in place: the addresses stay)."""
            keys, values = self.keys.index_select(0, idx), self.values.index_select(0, idx)  # copies first
            self._bind(len(idx))
            self.keys.copy_(keys)
            self.values.copy_(values)

    return PooledLayer


# --- transformers engine ---------------------------------------------------------------------

@dataclass
class _Row:
    prompt: list[int]
    max_new: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    stop: int | None = None
    reuse: _Entry | None = None  # cached KV of a prefix of the prompt


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
        from prorag.modeling import load_policy

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
        self.base = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self._peft = None  # PeftModel wrapping self.base once an adapter is loaded (merge_adapters off)
        self._adapters: dict[str, tuple[str, str]] = {}  # key -> (peft adapter name, path)
        self.merge_adapters = bool(merge_adapters)
        self._merged: dict[str, torch.nn.Module] = {}  # key -> base copy with that adapter merged in
        self._counter = 0
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
        self._compiled: dict[int, tuple[torch.nn.Module, object]] = {}  # id(model) -> (model, step fn | None)
        self._kv_pool = _KVPool()
        self._cudagraph_skips = 0

    # -- adapters --

    def load_adapter(self, key: str, path: str) -> None:
        if not key:
            raise InvalidArgument("adapter key must be non-empty")
        p = str(validate_adapter_dir(path).resolve())
        with self._lock:
            if already_loaded(self._adapters, key, p):
                return
            # PEFT names become module keys: a "." (as in "v1.2") would break them, so use our own
            self._counter += 1
            name = f"a{self._counter}"
            try:
                if self.merge_adapters:
                    self._merged[key] = self._merged_copy(p, name)
                elif self._peft is None:
                    from peft import PeftModel

                    self._peft = PeftModel.from_pretrained(self.base, p, adapter_name=name, is_trainable=False)
                else:
                    self._peft.load_adapter(p, adapter_name=name, is_trainable=False)
            except (ValueError, RuntimeError, KeyError) as e:
                raise FailedPrecondition(f"adapter {key!r} at {path} does not fit the base model: {e}") from e
            if self._peft is not None:
                self._peft.eval()
            self.prefix_cache.drop_adapter(key)  # a reload under this key may hold other weights
            self._adapters[key] = (name, p)

    def _merged_copy(self, path: str, name: str) -> torch.nn.Module:
        import copy

        from peft import PeftModel

        peft = PeftModel.from_pretrained(copy.deepcopy(self.base), path, adapter_name=name, is_trainable=False)
        return peft.merge_and_unload().eval()

    def unload_adapter(self, key: str) -> None:
        with self._lock:
            if key not in self._adapters:
                raise NotFound(f"adapter {key!r} is not loaded")
            name, _ = self._adapters.pop(key)
            self.prefix_cache.drop_adapter(key)  # a later load under this key may hold other weights
            if self._merged.pop(key, None) is not None:
                self._forget_compiled()
                return
            if not self._adapters:
                # removing the last adapter strips the LoRA layers: the base runs as before any load
                self.base = self._peft.unload()
                self._peft = None
                self._forget_compiled()
            else:
                if self._peft.active_adapter == name:
                    # move off the doomed adapter first (PEFT warns when the active one is deleted)
                    self._peft.set_adapter(next(iter(self._adapters.values()))[0], inference_mode=True)
                self._peft.delete_adapter(name)

    def _forget_compiled(self) -> None:
        """Drop the compiled steps of models no longer served (their wrappers hold the modules)."""
        alive = [self.base, *self._merged.values()]
        self._compiled = {k: v for k, v in self._compiled.items() if any(v[0] is m for m in alive)}

    def adapters(self) -> list[str]:
        return list(self._adapters)

    def info(self) -> dict:
        from prorag.modeling import num_parameters

        return {"engine": self.name, "model_path": self.model_path, "device": str(self.device),
                "dtype": str(next(self.base.parameters()).dtype).replace("torch.", ""),
                "num_parameters": num_parameters(self.base), "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "max_batch_size": self.max_batch_size,
                "adapters": self.adapters(), "prefix_cache_entries": len(self.prefix_cache),
                "prefix_cache_bytes": self.prefix_cache.bytes, "compile_decode": self.compile_decode,
                "decode_cache_bytes": self._kv_pool.nbytes, **self.stats}

    # -- generation --

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec, adapter: str | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[GeneratedSeq]]:
        params.validate()
        check_prompts(prompts, self.vocab_size, self.max_model_len)
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidArgument(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        stops = set(int(t) for t in params.stop_token_ids)
        if self.eos_id is not None:
            stops.add(int(self.eos_id))  # like vLLM: EOS always ends a sequence
        rows: list[_Row] = []
        for i, p in enumerate(prompts):
            # prompt i's stream: its own seed, else one derived from params.seed (as VLLMEngine does)
            prompt_seed = derive_seed(params.seed, i) if seeds is None else int(seeds[i])
            for j in range(params.n):
                s = derive_seed(prompt_seed, j)
                g = torch.Generator().manual_seed(s) if s else None
                rows.append(_Row(prompt=[int(t) for t in p], generator=g,
                                 max_new=min(params.max_tokens, self.max_model_len - len(p))))
        t0 = time.perf_counter()
        with self._lock:
            if adapter is not None and adapter not in self._adapters:
                raise NotFound(f"adapter {adapter!r} is not loaded (loaded: {', '.join(self._adapters) or 'none'})")
            found: dict[tuple, _Entry | None] = {}
            for r in rows:
                key = tuple(r.prompt)
                if key not in found:  # at least one token is always prefilled: it yields the first logits
                    found[key] = self.prefix_cache.longest_prefix(adapter, r.prompt, len(r.prompt) - 1)
                r.reuse = found[key]
            # rows with similar numbers of new tokens share a chunk (the prefill pads to the largest);
            # identical prompts stay adjacent so a chunk prefills each once
            order = sorted(range(len(rows)), key=lambda k: (
                len(rows[k].prompt) - (len(rows[k].reuse.ids) if rows[k].reuse else 0), rows[k].prompt))
            with self._adapter_context(adapter), torch.inference_mode():
                for c in range(0, len(order), self.max_batch_size):
                    self._decode([rows[k] for k in order[c:c + self.max_batch_size]], params, stops, adapter)
        for r in rows:
            r.reuse = None
        self.stats["generate_calls"] += 1
        self.stats["generated_tokens"] += sum(len(r.out) for r in rows)
        self.stats["generate_s"] += time.perf_counter() - t0
        seqs = [GeneratedSeq(r.out, r.logprobs, r.finish, r.stop) for r in rows]
        return [seqs[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _model_for(self, adapter: str | None) -> torch.nn.Module:
        return self._merged.get(adapter, self.base) if adapter is not None else self.base

    def _adapter_context(self, adapter: str | None):
        if self._peft is None:
            return contextlib.nullcontext()
        if adapter is None:
            return self._peft.disable_adapter()
        self._peft.set_adapter(self._adapters[adapter][0], inference_mode=True)
        return contextlib.nullcontext()

    def _prefill(self, uniq: list[_Row], T: int, adapter: str | None, make_cache=None):
        """Prefill each distinct prompt once, reusing cached prefix KV.

        Layout: [U, C + Q] with every sequence right-aligned: C cached columns (a row's reused
        prefix, left-padded) then Q query columns (the tokens actually run). Returns
        (cache, last logits [U, V], attention mask [U, C + Q], next position [U]).
        make_cache: length -> cache holding at least that many columns (default: a new cache of self.cache's kind).
        """
        from transformers import DynamicCache, StaticCache

        dev, model = self.device, self._model_for(adapter)
        U = len(uniq)
        Q = max(len(r.prompt) - (len(r.reuse.ids) if r.reuse else 0) for r in uniq)
        reuse = [max(0, len(r.prompt) - Q) for r in uniq]  # <= the cached length by the choice of Q
        C = max(reuse)
        ids = torch.full((U, Q), self.pad_id, dtype=torch.long)
        attn = torch.zeros((U, C + Q), dtype=torch.long)
        for u, r in enumerate(uniq):
            tail = r.prompt[reuse[u]:]
            ids[u, Q - len(tail):] = torch.tensor(tail)
            attn[u, C - reuse[u]:C] = 1
            attn[u, C + Q - len(tail):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, C:]
        if make_cache is not None:
            cache = make_cache(C + Q + T)
        elif self.cache == "static":
            cache = StaticCache(config=model.config, max_cache_len=C + Q + T)
        else:
            cache = DynamicCache(config=model.config)
        if C:
            for layer in range(len(uniq[reuse.index(C)].reuse.keys)):
                k0 = next(r.reuse.keys[layer] for r, n in zip(uniq, reuse) if n)
                ks = k0.new_zeros((U, k0.shape[0], C, k0.shape[2]))
                vs = ks.clone()
                for u, r in enumerate(uniq):
                    if reuse[u]:
                        ks[u, :, C - reuse[u]:] = r.reuse.keys[layer][:, :reuse[u]]
                        vs[u, :, C - reuse[u]:] = r.reuse.values[layer][:, :reuse[u]]
                cache.update(ks, vs, layer)  # the public way in: works for static and dynamic caches
        self.stats["prefill_tokens"] += int(attn[:, C:].sum())
        self.stats["reused_tokens"] += sum(reuse)
        ids, attn, pos = ids.to(dev), attn.to(dev), pos.to(dev)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :].float(), attn, pos[:, -1] + 1

    def _keep_kv(self, rows: list[_Row], k: int, cache, attn_row: torch.Tensor, slot: int, adapter) -> None:
        """Store the KV of row k's prompt + generated tokens (all but the last, never fed back)."""
        if self.prefix_cache.max_bytes <= 0:
            return
        r = rows[k]
        cols = attn_row.nonzero().squeeze(-1)
        ids = r.prompt + r.out[:-1]
        if len(cols) != len(ids):  # cannot happen; never store something misaligned
            return
        keys = [layer.keys[slot, :, cols].clone() for layer in cache.layers]
        values = [layer.values[slot, :, cols].clone() for layer in cache.layers]
        self.prefix_cache.put(adapter, ids, keys, values)

    @staticmethod
    def _unique_prompts(rows: list[_Row]) -> tuple[list[_Row], list[int]]:
        """(first row of each distinct prompt, index into it per row): n samples of a prompt share one prefill."""
        index: dict[tuple, int] = {}
        uniq: list[_Row] = []
        expand = []
        for r in rows:
            key = tuple(r.prompt)
            if key not in index:
                index[key] = len(uniq)
                uniq.append(r)
            expand.append(index[key])
        return uniq, expand

    def _decode(self, rows: list[_Row], params: SamplingSpec, stops: set[int], adapter: str | None) -> None:
        """Prefill, then one token per step for the live rows only."""
        dev, model = self.device, self._model_for(adapter)
        if self.compile_decode and self._compiled_step(model) is not None:
            return self._decode_compiled(rows, params, stops, adapter)
        T = max(r.max_new for r in rows)
        uniq, expand = self._unique_prompts(rows)
        cache, logits, attn, next_pos = self._prefill(uniq, T, adapter)
        if len(uniq) < len(rows):
            idx = torch.tensor(expand, dtype=torch.long, device=dev)
            cache.reorder_cache(idx)  # n samples of one prompt share its prefill
            logits, attn, next_pos = logits[idx], attn[idx], next_pos[idx]
        live = list(range(len(rows)))  # batch slot -> row index
        stop_t = torch.tensor(sorted(stops), dtype=torch.long, device=dev) if stops else None
        for _ in range(T):
            logp = torch.log_softmax(logits, dim=-1)
            tok = sample_tokens(logits, params.temperature, params.top_p,
                                [rows[k].generator for k in live]).to(dev)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            is_stop = torch.isin(tok, stop_t) if stop_t is not None else torch.zeros_like(tok, dtype=torch.bool)
            tok_l, lp_l, stop_l = tok.tolist(), tok_lp.tolist(), is_stop.tolist()
            keep = []
            for slot, k in enumerate(live):
                r = rows[k]
                if r.finish:
                    continue  # finished, but its slot is kept until the next compaction
                r.out.append(tok_l[slot])
                r.logprobs.append(lp_l[slot])
                if stop_l[slot]:
                    r.finish, r.stop = "stop", tok_l[slot]
                elif len(r.out) >= r.max_new:
                    r.finish = "length"
                else:
                    keep.append(slot)
                    continue
                self._keep_kv(rows, k, cache, attn[slot], slot, adapter)
            if not keep:
                break
            if len(keep) < len(live) * self.compact_below:
                # finished rows stop costing compute: keep only the live slots in every tensor
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.reorder_cache(idx)
                tok, attn, next_pos = tok[idx], attn[idx], next_pos[idx]
                live = [live[s] for s in keep]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

    # -- compiled decoding --

    def _compiled_step(self, model: torch.nn.Module):
        """The compiled forward of ``model`` (compiled lazily: merged adapters are modules of their own), or None
        where it cannot be used (the reason is logged once)."""
        entry = self._compiled.get(id(model))
        if entry is not None and entry[0] is model:
            return entry[1]
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        step, why = None, ""
        try:
            kinds = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=1).layers
                     if type(layer) is not StaticLayer}
            if kinds:
                why = f"its static cache has {', '.join(sorted(kinds))} layers, which the pooled decode cache lacks"
            else:
                # reduce-overhead = CUDA graphs; they exist on CUDA only, and only inductor takes a mode.
                # dynamic=None: the first shape compiles static, a second one recompiles with dynamic sizes once
                mode = "reduce-overhead" if self.device.type == "cuda" and self.compile_backend == "inductor" else None
                _use_gqa_decode_attention(model)
                step = torch.compile(model, backend=self.compile_backend, mode=mode, fullgraph=False, dynamic=None)
        except Exception as e:  # noqa: BLE001 - whatever the reason, the request is decoded uncompiled
            step, why = None, f"{type(e).__name__}: {e}"
        if why:
            log.warning("compile_decode: %s decodes uncompiled: %s", type(model).__name__, why)
        self._compiled[id(model)] = (model, step)
        return step

    def _forward_step(self, model, cache, ids, mask, pos, written: int) -> torch.Tensor:
        """One decode step -> float32 logits [B, V], through the compiled forward when there is one; a failure
        switches the model to eager decoding (logged) and redoes the step, never failing the request."""
        step = self._compiled_step(model)
        if step is not None:
            try:
                if self.device.type == "cuda":
                    # the last step's graph outputs are dead: the replay may overwrite them
                    torch.compiler.cudagraph_mark_step_begin()
                out = step(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                self.stats["compiled_steps"] += 1
                self._note_cudagraph_skips()
                # a copy: the graph's output buffer is overwritten by the next replay
                return out.logits[:, -1, :].to(torch.float32, copy=True)
            except Exception as e:  # noqa: BLE001 - dynamo, inductor and CUDA graph failures share no base class
                log.warning("compile_decode: the compiled decode step of %s failed, decoding uncompiled from now on: "
                            "%s: %s", type(model).__name__, type(e).__name__, e)
                self._compiled[id(model)] = (model, None)
                for layer in cache.layers:  # a step that broke part-way may have moved some write positions
                    layer.cumulative_length.fill_(written)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].float()

    def _note_cudagraph_skips(self) -> None:
        if self.device.type != "cuda":
            return
        from torch._dynamo.utils import counters

        skips = counters["inductor"]["cudagraph_skips"]
        if skips != self._cudagraph_skips:
            self._cudagraph_skips = skips
            log.warning("compile_decode: CUDA graphs were skipped for a decode step (it runs compiled, without "
                        "graphs; TORCH_LOGS=perf_hints says why)")

    def _decode_compiled(self, rows: list[_Row], params: SamplingSpec, stops: set[int], adapter: str | None) -> None:
        """_decode with the one-token step compiled: the same tokens, logprobs and cached prefixes.

        What differs, invisibly in the outputs: the cache lives in self._kv_pool with its length rounded up to
        CACHE_LEN_STEP and its batch padded to a batch_bucket (padding rows copy a real row; their tokens are never
        read), so a graph serves many chunks; the attention mask is allocated at the cache's length; and tokens are
        read back every stop_check_every steps, so finished rows may decode a few more tokens, which are dropped.
        """
        dev, model = self.device, self._model_for(adapter)
        T = max(r.max_new for r in rows)
        uniq, expand = self._unique_prompts(rows)

        def make_cache(length: int):
            return _pooled_static_cache(model, -(-length // CACHE_LEN_STEP) * CACHE_LEN_STEP, self._kv_pool)

        cache, logits, attn, next_pos = self._prefill(uniq, T, adapter, make_cache=make_cache)
        width, L = attn.shape[1], cache.layers[0].max_cache_len
        n = len(rows)  # slots in use; slots n.. are padding
        bucket = batch_bucket(n, self.max_batch_size)
        idx = torch.tensor(expand + [0] * (bucket - n), dtype=torch.long, device=dev)
        for layer in cache.layers:
            layer.rebatch(idx)
        mask = torch.zeros((bucket, L), dtype=attn.dtype, device=dev)
        mask[:, :width] = attn[idx]
        logits, pos = logits[idx], next_pos[idx]
        live = list(range(n))  # slot -> row index
        stop_t = torch.tensor(sorted(stops), dtype=torch.long, device=dev) if stops else None
        pending: list[torch.Tensor] = []  # per step since the last read-back: [3, n] (token, logprob, stopped)
        for t in range(T):
            lg = logits[:n]
            tok = sample_tokens(lg, params.temperature, params.top_p, [rows[k].generator for k in live]).to(dev)
            tok_lp = torch.log_softmax(lg, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
            is_stop = torch.isin(tok, stop_t) if stop_t is not None else torch.zeros_like(tok, dtype=torch.bool)
            # float64 holds token ids and float32 logprobs exactly: one copy to the host per read-back
            pending.append(torch.stack([tok.double(), tok_lp.double(), is_stop.double()]))
            if len(pending) == self.stop_check_every or t == T - 1:
                for toks, lps, stopped in torch.stack(pending).tolist():
                    for slot, k in enumerate(live):
                        r = rows[k]
                        if r.finish:
                            continue
                        r.out.append(int(toks[slot]))
                        r.logprobs.append(lps[slot])
                        if stopped[slot]:
                            r.finish, r.stop = "stop", int(toks[slot])
                        elif len(r.out) >= r.max_new:
                            r.finish = "length"
                        else:
                            continue
                        # its KV columns: the prompt's, then one per generated token but the last
                        self._keep_kv(rows, k, cache, mask[slot, :width + len(r.out) - 1], slot, adapter)
                pending.clear()
                keep = [slot for slot, k in enumerate(live) if not rows[k].finish]
                if not keep:
                    break
                smaller = batch_bucket(len(keep), self.max_batch_size)
                if len(keep) < n * self.compact_below and smaller < bucket:
                    # into a smaller bucket (another graph): finished rows stop costing compute
                    sel = torch.tensor(keep + [keep[0]] * (smaller - len(keep)), dtype=torch.long, device=dev)
                    for layer in cache.layers:
                        layer.rebatch(sel)
                    tok, mask, pos = tok[sel[:len(keep)]], mask[sel], pos[sel]
                    live, n, bucket = [live[s] for s in keep], len(keep), smaller
            mask[:, width + t] = 1
            ids = tok if n == bucket else torch.cat([tok, tok.new_zeros(bucket - n)])
            logits = self._forward_step(model, cache, ids[:, None], mask, pos[:, None], width + t)
            pos = pos + 1


__all__ = ["SamplingSpec", "GeneratedSeq", "GenerationEngine", "TransformersEngine", "PrefixKVCache",
           "derive_seed", "prefix_hashes", "validate_adapter_dir", "check_prompts", "top_p_filter",
           "sample_tokens", "ADAPTER_FILES"]
