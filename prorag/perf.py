"""Roofline figures for benchmarks: how fast a piece of work could go at best on given hardware."""

from __future__ import annotations


def decode_bandwidth_limit(model, batch: int, context_len: int, dtype_bytes: float,
                           bandwidth_bytes_per_s: float) -> float:
    """The most tokens/s batched decoding can reach when memory bandwidth is the limit.

    Each decode step reads every weight once and the whole KV cache once, and yields ``batch`` tokens:

        bytes_per_step = (P - E) * dtype_bytes + batch * context_len * layers * 2 * kv_heads * head_dim * dtype_bytes
        tokens_per_s   = batch * bandwidth_bytes_per_s / bytes_per_step

    P: the model's distinct parameters (tied embeddings once); E: the input embedding table when it is not tied to
    the LM head (a step reads only ``batch`` of its rows), else 0. context_len: KV positions read per step, with a
    static cache its preallocated length (prompt + new tokens), since attention reads all of it every step.
    Activations, logits and the small reads are left out, so real decoding stays below this.

    model: a transformers causal LM (its config gives layers, KV heads and head size).
    """
    if batch < 1 or context_len < 0 or dtype_bytes <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError("batch >= 1, context_len >= 0, dtype_bytes > 0 and bandwidth > 0 are required")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    params: dict[int, int] = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embed:
        params.pop(id(embed), None)
    weight_bytes = sum(params.values()) * dtype_bytes
    kv_bytes = batch * context_len * layers * 2 * kv_heads * head_dim * dtype_bytes
    return batch * bandwidth_bytes_per_s / (weight_bytes + kv_bytes)
