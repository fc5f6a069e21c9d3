"""Structured initialisation of the embedded Qwen3: an induction circuit wired in at init.

Why: the agent must copy names (from the question into a subquery, from a subanswer into the next
subquery), which a transformer does with an induction circuit: a previous-token head, then a head
that attends to the token after an earlier occurrence of the current one. Trained from random
init on 2 CPU cores such a circuit only formed after ~1,250 copy-task steps and was erased by the
reading phases (docs/BENCHMARKS.md), while the paper's Qwen3-8B has it from pre-training. So the
``cpu-induction`` preset starts with one, built by hand, and training refines it:

- layer 0, kv group 0: previous-token heads. Query and key read a direction ``u`` that every token
  embedding shares; the key is rotated by one position's RoPE angle on the three fastest pairs, so
  the score peaks at the previous position. The value reads the token (subspace A) and the output
  writes it into subspace B.
- layer 1, kv group 0: induction heads. The query reads the current token (A) and the key reads
  B (the previous token), both on the slowest RoPE pairs so distance barely matters; the value
  reads the attended token (C) and the output writes it back, where the tied LM head reads it.
- every other residual branch (attention output and MLP down projections) starts at zero, as in
  Fixup/ReZero-style inits, so random branches do not drown the circuit; training grows them.

Embeddings are scaled so the copied token wins the softmax by a useful margin (unscaled, the right
token ranked first with no margin and training erased the circuit within 25 steps). Measured: it
copies random strings seen earlier in the context at ~97% token accuracy before any training,
~77% after 100 copy-task steps at lr 3e-3 with a short ramp, and 36-47% after the whole warm-up
(docs/BENCHMARKS.md). Pure torch, no I/O.
"""

from __future__ import annotations

import math

import torch

#: RoPE pairs used by the previous-token key/query (fastest first) and their weights
_POSITION_PAIRS = {0: 0.5, 1: 0.3, 2: 0.2}
#: number of slowest RoPE pairs the induction head matches tokens on
_CONTENT_PAIRS = 7


def _orthonormal_rows(n: int, dim: int, exclude: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[n, dim] orthonormal rows, all orthogonal to the unit vector ``exclude``."""
    m = torch.randn(dim, n, generator=gen)
    m -= torch.outer(exclude, exclude @ m)
    q, _ = torch.linalg.qr(m)
    return q.T.contiguous()


def induction_shape_problem(num_layers: int, head_dim: int, hidden_size: int) -> str | None:
    """Why a model of this shape cannot take the circuit, or None when it can."""
    if num_layers < 2 or head_dim // 2 < len(_POSITION_PAIRS) + _CONTENT_PAIRS or hidden_size <= 3 * head_dim:
        return (f"induction init needs >= 2 layers, head_dim >= {2 * (len(_POSITION_PAIRS) + _CONTENT_PAIRS)} and "
                f"hidden_size > 3 * head_dim (got {num_layers}, {head_dim}, {hidden_size})")
    return None


def wire_induction_circuit(model, seed: int = 0, embed_scale: float = 10.0, prev_scale: float = 0.15,
                           copy_scale: float = 1.0, norm_gain: float = 2.0) -> None:
    """Wire a previous-token + induction circuit into a freshly initialised Qwen3 ``model`` in place.

    Requires >= 2 layers, head_dim >= 2 * (3 + _CONTENT_PAIRS) and hidden_size > 3 * head_dim.
    embed_scale: multiplies the random embeddings (logit margin of the copied token);
    prev_scale / copy_scale: output scales of the previous-token and induction heads, relative to
    the embedding norm; norm_gain: initial q/k RMSNorm weights of the two wired layers (sharpness).
    """
    c = model.config
    hidden, head_dim, heads, kv_heads = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    half = head_dim // 2
    problem = induction_shape_problem(c.num_hidden_layers, head_dim, hidden)
    if problem:
        raise ValueError(problem)
    rope = c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta
    theta = [rope ** (-2 * i / head_dim) for i in range(half)]
    group = heads // kv_heads  # query heads sharing kv group 0
    gen = torch.Generator().manual_seed(seed + 7919)
    u = torch.randn(hidden, generator=gen)
    u /= u.norm()

    def kv_rows(w):  # [kv_heads, head_dim, hidden] view of a k/v projection
        return w.view(kv_heads, head_dim, hidden)

    def q_rows(w):
        return w.view(heads, head_dim, hidden)

    def o_cols(w):  # [hidden, heads, head_dim] view of an output projection
        return w.view(hidden, heads, head_dim)

    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
            layer.self_attn.o_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        emb.mul_(embed_scale)
        scale = float(emb.norm(dim=1).mean())
        emb.add_(u * scale)  # the shared direction the positional head reads

        # layer 0: q and k constant (from u); HF RoPE pairs dims (i, i + half), k = R(theta_i) q
        q_pos, k_pos = torch.zeros(head_dim), torch.zeros(head_dim)
        for i, weight in _POSITION_PAIRS.items():
            amp = math.sqrt(weight)
            q_pos[i] = amp
            k_pos[i], k_pos[i + half] = amp * math.cos(theta[i]), amp * math.sin(theta[i])
        a, b, cc = _orthonormal_rows(3 * head_dim, hidden, u, gen).split(head_dim)  # mutually orthogonal
        attn0 = model.model.layers[0].self_attn
        kv_rows(attn0.k_proj.weight)[0].copy_(torch.outer(k_pos, u) * 3)
        q_rows(attn0.q_proj.weight)[:group].copy_(torch.outer(q_pos, u) * 3)
        kv_rows(attn0.v_proj.weight)[0].copy_(a)
        o_cols(attn0.o_proj.weight)[:, :group, :].copy_((b.T * (prev_scale * embed_scale / group)).unsqueeze(1))
        attn0.q_norm.weight.fill_(norm_gain)
        attn0.k_norm.weight.fill_(norm_gain)

        # layer 1: match current token (A) with the previous token written in B, on slow RoPE pairs
        slow = [i for i in range(half - _CONTENT_PAIRS, half)]
        slow = slow + [i + half for i in slow]
        attn1 = model.model.layers[1].self_attn
        q1, k1 = torch.zeros(head_dim, hidden), torch.zeros(head_dim, hidden)
        q1[slow], k1[slow] = a[:len(slow)], b[:len(slow)]
        kv_rows(attn1.k_proj.weight)[0].copy_(k1)
        q_rows(attn1.q_proj.weight)[:group].copy_(q1)
        kv_rows(attn1.v_proj.weight)[0].copy_(cc)
        o_cols(attn1.o_proj.weight)[:, :group, :].copy_((cc.T * (copy_scale * embed_scale / group)).unsqueeze(1))
        attn1.q_norm.weight.fill_(norm_gain)
        attn1.k_norm.weight.fill_(norm_gain)


__all__ = ["induction_shape_problem", "wire_induction_circuit"]
