"""Token-level losses (pure torch, no I/O, no model calls).

Running the model is the caller's part (prorag.training.lm.weighted_lm_loss runs the trunk on every position and
the LM head only on trained ones); these functions only see logits and targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def weighted_token_ce(logits: torch.Tensor, targets: torch.Tensor,
                      weights: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Weighted token cross-entropy: sum_i w_i * CE_i / sum_i w_i over targets != IGNORE_INDEX.

    logits [..., V] (computed in fp32 whatever their dtype); targets [...] long; weights [...] float,
    same leading shape. ProRAG's format-aware SFT loss is this with per-tag weights; all-ones
    weights give the plain token mean. Returns (loss scalar, number of trained tokens); no trained
    token -> loss 0.
    """
    mask = targets != IGNORE_INDEX
    ce = F.cross_entropy(logits[mask].float(), targets[mask], reduction="none")
    w = weights[mask].to(ce.dtype)
    return (ce * w).sum() / w.sum().clamp(min=1e-8), int(mask.sum())


#: name -> loss function, for configuration
LOSSES = {"weighted_token_ce": weighted_token_ce}

__all__ = ["IGNORE_INDEX", "LOSSES", "weighted_token_ce"]
