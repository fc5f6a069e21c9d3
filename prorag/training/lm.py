"""The causal-LM loss of a batch: the model's trunk on every position, its LM head on trained ones only."""

from __future__ import annotations

from prorag.algorithms.losses import IGNORE_INDEX, weighted_token_ce


def weighted_lm_loss(model, input_ids, attention_mask, labels, weights):
    """Format-aware loss of a Hugging Face causal LM: sum_t w_t * CE_t / sum_t w_t over labels != -100.

    input_ids/attention_mask/labels [B,T] (labels -100 = not trained); weights [B,T].
    Position t predicts labels[t+1]. The LM head runs only on trained positions (about a fifth
    of a trajectory: prompt, documents and glue are masked), which halved the SFT step time on CPU.
    Returns (loss, number of trained tokens).
    """
    # use_cache=False: a training forward stores no KV cache (it cost memory, and under torch.compile its per-layer
    # state made each decoder block recompile)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    logits = model.get_output_embeddings()(hidden[:, :-1][mask])
    return weighted_token_ce(logits, target[mask], weights[:, 1:][mask])


__all__ = ["weighted_lm_loss"]
