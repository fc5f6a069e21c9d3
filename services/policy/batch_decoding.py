"""The transformers engine's batched decoding of one chunk of rows: each distinct prompt prefilled once (from its
cached prefix where one is kept), then one token per step for the rows still live, finished rows compacted away
and their KV kept for reuse. The eager loop and the compiled one (compiled_decode) give the same outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from prorag.engine import SamplingSpec
from services.policy.compiled_decode import CompiledSteps, batch_bucket
from services.policy.prefix_cache import CachedPrefix, PrefixKVCache
from services.policy.sampling import sample_tokens, sampled_logprobs


@dataclass
class Row:
    prompt: list[int]
    max_new: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    stop: int | None = None
    reuse: CachedPrefix | None = None  # cached KV of a prefix of the prompt


class BatchDecoder:
    def __init__(self, *, device: torch.device, pad_id: int, cache: str, compact_below: float, max_batch_size: int,
                 stop_check_every: int, prefix_cache: PrefixKVCache, stats: dict, compiled: CompiledSteps | None):
        """cache: "static" or "dynamic" (the eager loop's KV cache); compiled: the compiled decode steps, None = eager
        only. The counters of prefilled and reused tokens go into ``stats`` (the engine's)."""
        self.device, self.pad_id, self.cache = device, pad_id, cache
        self.compact_below, self.max_batch_size = compact_below, max_batch_size
        self.stop_check_every = stop_check_every
        self.prefix_cache, self.stats, self.compiled = prefix_cache, stats, compiled

    def _prefill(self, model, uniq: list[Row], T: int, make_cache=None):
        """Prefill each distinct prompt once, reusing cached prefix KV.

        Layout: [U, C + Q] with every sequence right-aligned: C cached columns (a row's reused
        prefix, left-padded) then Q query columns (the tokens actually run). Returns
        (cache, last logits [U, V], attention mask [U, C + Q], next position [U]).
        make_cache: length -> cache holding at least that many columns (default: a new cache of self.cache's kind).
        """
        dev = self.device
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

    def _keep_kv(self, rows: list[Row], k: int, cache, attn_row: torch.Tensor, slot: int, adapter) -> None:
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
    def _unique_prompts(rows: list[Row]) -> tuple[list[Row], list[int]]:
        """(first row of each distinct prompt, index into it per row): n samples of a prompt share one prefill."""
        index: dict[tuple, int] = {}
        uniq: list[Row] = []
        expand = []
        for r in rows:
            key = tuple(r.prompt)
            if key not in index:
                index[key] = len(uniq)
                uniq.append(r)
            expand.append(index[key])
        return uniq, expand

    def decode(self, model, rows: list[Row], params: SamplingSpec, stops: set[int], adapter: str | None) -> None:
        """Prefill, then one token per step for the live rows only; ``adapter`` keys the rows' cached prefixes."""
        dev = self.device
        if self.compiled is not None and self.compiled.step_for(model) is not None:
            return self._decode_compiled(model, rows, params, stops, adapter)
        T = max(r.max_new for r in rows)
        uniq, expand = self._unique_prompts(rows)
        cache, logits, attn, next_pos = self._prefill(model, uniq, T)
        if len(uniq) < len(rows):
            idx = torch.tensor(expand, dtype=torch.long, device=dev)
            cache.reorder_cache(idx)  # n samples of one prompt share its prefill
            logits, attn, next_pos = logits[idx], attn[idx], next_pos[idx]
        live = list(range(len(rows)))  # batch slot -> row index
        stop_t = torch.tensor(sorted(stops), dtype=torch.long, device=dev) if stops else None
        for _ in range(T):
            tok = sample_tokens(logits, params.temperature, params.top_p,
                                [rows[k].generator for k in live]).to(dev)
            tok_lp = sampled_logprobs(logits, tok, params.temperature, params.top_p, params.tempered_logprobs)
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

    def _decode_compiled(self, model, rows: list[Row], params: SamplingSpec, stops: set[int],
                         adapter: str | None) -> None:
        """_decode with the one-token step compiled: the same tokens, logprobs and cached prefixes.

        What differs, invisibly in the outputs: the cache lives in the compiled steps' KV pool with its length rounded
        up to CACHE_LEN_STEP and its batch padded to a batch_bucket (padding rows copy a real row; their tokens are
        never read), so a graph serves many chunks; the attention mask is allocated at the cache's length; and tokens
        are read back every stop_check_every steps, so finished rows may decode a few more tokens, which are dropped.
        """
        dev = self.device
        T = max(r.max_new for r in rows)
        uniq, expand = self._unique_prompts(rows)
        cache, logits, attn, next_pos = self._prefill(
            model, uniq, T, make_cache=lambda length: self.compiled.static_cache(model, length))
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
            tok_lp = sampled_logprobs(lg, tok, params.temperature, params.top_p, params.tempered_logprobs)
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
            logits = self.compiled.forward(model, cache, ids[:, None], mask, pos[:, None], width + t)
            pos = pos + 1
