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
    # no boolean indexing of the logits: it copies the [..., V] block, and its backward scatters into a zero block
    # of that size; cross_entropy skips ignored targets itself (CE 0 there) and their weight is zeroed
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none")
    w = torch.where(mask.reshape(-1), weights.reshape(-1).to(ce.dtype), 0.0)
    return (ce * w).sum() / w.sum().clamp(min=1e-8), int(mask.sum())


def linear_ce_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of logits = hidden @ head_weight.T (in fp32): hidden [n, H], head_weight [V, H],
    targets [n] long -> scalar. The reference :func:`weighted_linear_ce` computes with unless given a fused kernel."""
    return F.cross_entropy(F.linear(hidden, head_weight).float(), targets, reduction="sum")


def weighted_linear_ce(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                       sum_ce=linear_ce_sum) -> tuple[torch.Tensor, int]:
    """weighted_token_ce of logits = hidden @ head_weight.T, its head and cross-entropy left to ``sum_ce`` so a fused
    kernel (liger-kernel's fused linear cross-entropy on a GPU) can compute them without the [N, V] logits.

    hidden [N, H]; head_weight [V, H]; targets [N] long (IGNORE_INDEX = not trained); weights [N] float.
    sum_ce(hidden_g [n, H], head_weight, targets_g [n]) -> the rows' summed CE (a scalar). A fused kernel sums with
    one weight for all its rows, so the rows are grouped by weight and each group summed once: the format-aware
    loss gives each tag its own weight, a handful of groups, and every row's head is still computed once.
    Returns (loss scalar, number of trained tokens), equal to weighted_token_ce(hidden @ head_weight.T, ...).
    """
    keep = targets != IGNORE_INDEX
    h, t, w = hidden[keep], targets[keep], weights[keep].float()
    total = hidden.sum().float() * 0.0  # keeps the graph when no row has a weight: backward gives zero gradients
    for value in torch.unique(w).tolist():
        if value != 0.0:  # rows of weight 0 add nothing
            rows = w == value
            total = total + value * sum_ce(h[rows], head_weight, t[rows]).float()
    return total / w.sum().clamp(min=1e-8), int(keep.sum())


#: name -> loss function, for configuration
LOSSES = {"weighted_token_ce": weighted_token_ce}

__all__ = ["IGNORE_INDEX", "LOSSES", "linear_ce_sum", "weighted_linear_ce", "weighted_token_ce"]
