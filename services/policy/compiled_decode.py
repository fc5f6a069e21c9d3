"""Compiled decoding for the transformers engine: the one-token decode step through torch.compile (CUDA graphs on
a GPU) over a static KV cache whose memory outlives each chunk, so a recorded graph keeps replaying."""

from __future__ import annotations

import logging

import numpy as np
import torch
from transformers import AttentionInterface, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# the engine's logger: a compile failure is the engine's news to whoever reads its log
log = logging.getLogger("prorag.policy.engine")

#: the static cache's length is rounded up to a multiple of this, so chunks of similar lengths replay one graph
CACHE_LEN_STEP = 128


def batch_bucket(n: int, cap: int) -> int:
    """The batch size a chunk of ``n`` live rows is padded to: the next power of two, or ``cap`` (>= n) when smaller.

    A CUDA graph replays one shape only; a few buckets keep the number of recorded graphs small.

    >>> [batch_bucket(n, 48) for n in (1, 3, 4, 17, 40, 48)]
    [1, 4, 4, 32, 48, 48]
    """
    return min(1 << (max(1, n) - 1).bit_length(), max(n, cap))


class KVPool:
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


def pooled_static_cache(model, max_cache_len: int, pool: KVPool):
    """A transformers StaticCache whose layers keep their tensors in ``pool`` (plain full-attention models only:
    the engine checks the layer types before it compiles)."""
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache.layers = [PooledLayer(max_cache_len, pool, i) for i in range(len(cache.layers))]
    return cache


#: transformers' sdpa attention, with one-token queries on grouped KV heads run without copies of K and V
GQA_DECODE_ATTENTION = "prorag_sdpa_gqa_decode"


def _sdpa_gqa_decode(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except for a one-token query on grouped KV heads (GQA): the query heads of a
    group become the query length, so SDPA reads each KV head once. Under torch.compile transformers instead repeats
    K and V to every query head (repeat_kv, as SDPA's own GQA takes no mask on CUDA), which writes and reads the
    whole cache several times over in a step that is bound by reading it once. Eager transformers does the same
    packing for one-token queries (its pack_gqa, from 5.2x on), only not under compile."""
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


def use_gqa_decode_attention(model) -> None:
    """Switch an sdpa model with grouped KV heads to GQA_DECODE_ATTENTION (its masks stay sdpa's)."""
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


class PooledLayer(StaticLayer):
    """StaticLayer allocating from a KVPool (its documented hook: lazy_initialization); rebatch moves rows."""

    _layer_type = None  # never registered as the default static layer

    def __init__(self, max_cache_len: int, pool: KVPool, index: int):
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


class CompiledSteps:
    """The compiled decode step of each model served, compiled lazily (a merged adapter is a module of its own), and
    the KV pool their caches live in. Stats of compiled steps go into ``stats`` (the engine's)."""

    def __init__(self, device: torch.device, backend, stats: dict):
        self.device, self.backend, self.stats = device, backend, stats
        self.steps: dict[int, tuple[torch.nn.Module, object]] = {}  # id(model) -> (model, step fn | None)
        self.kv_pool = KVPool()
        self._cudagraph_skips = 0

    def static_cache(self, model, length: int):
        """A pooled static cache of at least ``length`` columns, rounded up so similar lengths share a graph."""
        return pooled_static_cache(model, -(-length // CACHE_LEN_STEP) * CACHE_LEN_STEP, self.kv_pool)

    def step_for(self, model: torch.nn.Module):
        """The compiled forward of ``model`` (compiled lazily: merged adapters are modules of their own), or None
        where it cannot be used (the reason is logged once)."""
        entry = self.steps.get(id(model))
        if entry is not None and entry[0] is model:
            return entry[1]
        step, why = None, ""
        try:
            kinds = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=1).layers
                     if type(layer) is not StaticLayer}
            if kinds:
                why = f"its static cache has {', '.join(sorted(kinds))} layers, which the pooled decode cache lacks"
            else:
                # reduce-overhead = CUDA graphs; they exist on CUDA only, and only inductor takes a mode.
                # dynamic=None: the first shape compiles static, a second one recompiles with dynamic sizes once
                mode = "reduce-overhead" if self.device.type == "cuda" and self.backend == "inductor" else None
                use_gqa_decode_attention(model)
                step = torch.compile(model, backend=self.backend, mode=mode, fullgraph=False, dynamic=None)
        except Exception as e:  # noqa: BLE001 - whatever the reason, the request is decoded uncompiled
            step, why = None, f"{type(e).__name__}: {e}"
        if why:
            log.warning("compile_decode: %s decodes uncompiled: %s", type(model).__name__, why)
        self.steps[id(model)] = (model, step)
        return step

    def forward(self, model, cache, ids, mask, pos, written: int) -> torch.Tensor:
        """One decode step -> float32 logits [B, V], through the compiled forward when there is one; a failure
        switches the model to eager decoding (logged) and redoes the step, never failing the request."""
        step = self.step_for(model)
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
                self.steps[id(model)] = (model, None)
                for layer in cache.layers:  # a step that broke part-way may have moved some write positions
                    layer.cumulative_length.fill_(written)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].float()

    def _note_cudagraph_skips(self) -> None:
        if self.device.type != "cuda":
            return
        # torch._dynamo's import takes seconds: paid only where CUDA graphs run
        from torch._dynamo.utils import counters

        skips = counters["inductor"]["cudagraph_skips"]
        if skips != self._cudagraph_skips:
            self._cudagraph_skips = skips
            log.warning("compile_decode: CUDA graphs were skipped for a decode step (it runs compiled, without "
                        "graphs; TORCH_LOGS=perf_hints says why)")

    def keep_only(self, served: list[torch.nn.Module]) -> None:
        """Drop the compiled steps of models no longer served (their wrappers hold the modules)."""
        self.steps = {k: v for k, v in self.steps.items() if any(v[0] is m for m in served)}
