"""Drawing the next token from logits (pure torch): top-p filtering, per-row seeded sampling and the drawn tokens'
log-probs."""

from __future__ import annotations

from typing import Sequence

import torch


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


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float,
                     tempered: bool | None) -> torch.Tensor:
    """Log-prob of each row's drawn token. logits: [B, V] float32, tokens: [B] -> [B].

    Raw (tempered False or None): log-softmax of the logits. Tempered: of the distribution ``sample_tokens`` drew
    from (logits / temperature, then top_p), what vLLM's processed_logprobs returns; greedy decoding (temperature 0)
    draws from none, so it gets the raw ones either way.
    """
    if tempered and temperature > 0:
        logits = top_p_filter(logits / temperature, top_p)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
