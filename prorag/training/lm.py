"""The causal-LM loss of a batch: the model's trunk on every position, its LM head on trained ones only."""

from __future__ import annotations

from typing import Callable

from prorag.algorithms.losses import IGNORE_INDEX, weighted_linear_ce, weighted_token_ce
from prorag.errors import FailedPrecondition, InvalidArgument


def weighted_lm_loss(model, input_ids, attention_mask, labels, weights, sum_ce: Callable | None = None):
    """Format-aware loss of a Hugging Face causal LM: sum_t w_t * CE_t / sum_t w_t over labels != -100.

    input_ids/attention_mask/labels [B,T] (labels -100 = not trained); weights [B,T].
    Position t predicts labels[t+1]. The LM head runs only on trained positions (about a fifth
    of a trajectory: prompt, documents and glue are masked), which halved the SFT step time on CPU.
    sum_ce: a fused head-and-cross-entropy kernel (:func:`fused_linear_ce_sum`) that computes them without the
    [tokens, vocab] logits; None = the head's logits, then the cross-entropy.
    Returns (loss, number of trained tokens).
    """
    # use_cache=False: a training forward stores no KV cache (it cost memory, and under torch.compile its per-layer
    # state made each decoder block recompile)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    head = model.get_output_embeddings()
    if sum_ce is None:
        return weighted_token_ce(head(hidden[:, :-1][mask]), target[mask], weights[:, 1:][mask])
    if getattr(head, "bias", None) is not None:
        raise InvalidArgument("fused_linear_ce: this model's LM head has a bias, which the fused kernel is not given; "
                              "set fused_linear_ce=false")
    return weighted_linear_ce(hidden[:, :-1][mask], head.weight, target[mask], weights[:, 1:][mask], sum_ce)


def fused_linear_ce_sum() -> Callable:
    """liger-kernel's fused linear cross-entropy (Triton, CUDA) as ``sum_ce(hidden [n, H], head_weight [V, H],
    targets [n]) -> summed CE``: the head's logits are computed and consumed in chunks, never the whole [n, V] block
    (at Qwen3's 151,936-token vocabulary that block, not the trunk, bounds the SFT step on a GPU)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        raise FailedPrecondition(f"fused_linear_ce needs liger-kernel ({e}): pip install liger-kernel on a CUDA host, "
                                 "or set fused_linear_ce=false") from None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda hidden, head_weight, targets: loss(head_weight, hidden, targets)


__all__ = ["fused_linear_ce_sum", "weighted_lm_loss"]
