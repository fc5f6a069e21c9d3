"""The transformers engine's reuse of prompt prefixes: the KV of finished sequences, kept (within a memory budget)
so that a later prompt extending one (a rollout's next round) prefills only its new tokens."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

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
class CachedPrefix:
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
        self._entries: "OrderedDict[tuple, CachedPrefix]" = OrderedDict()
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
        self._entries[key] = CachedPrefix(tuple(ids), keys, values, nbytes)
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

    def longest_prefix(self, adapter: str | None, ids: Sequence[int], max_len: int) -> CachedPrefix | None:
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
