"""Losses shared by the trainer's stages and the embedded base's warm-up (pure torch, no I/O)."""

from __future__ import annotations


def weighted_lm_loss(model, input_ids, attention_mask, labels, weights):
    """Format-aware loss: sum_t w_t * CE_t / sum_t w_t over tokens with labels != -100.

    input_ids/attention_mask/labels [B,T] (labels -100 = not trained); weights [B,T].
    Position t predicts labels[t+1]. The LM head runs only on trained positions (about a fifth
    of a trajectory: prompt, documents and glue are masked), which halves the step time on CPU.
    Returns (loss, number of trained tokens).
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    target = labels[:, 1:]
    mask = target != -100
    h = hidden[:, :-1][mask]
    logits = model.get_output_embeddings()(h).float()
    ce = F.cross_entropy(logits, target[mask], reduction="none")
    w = weights[:, 1:][mask]
    return (ce * w).sum() / w.sum().clamp(min=1e-8), int(mask.sum())


__all__ = ["weighted_lm_loss"]
