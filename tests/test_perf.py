"""prorag.perf: the memory-bandwidth roofline of batched decoding."""

import pytest
import torch

from prorag.modeling import PolicyModelConfig, build_model
from prorag.perf import decode_bandwidth_limit
from tests.conftest import VocabOnly

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=192)


def qwen3_params(vocab, h, layers, heads, kv_heads, hd, inter, tied):
    """Qwen3's parameters counted by hand: attention (q, k, v, o + q/k norms), MLP (gate, up, down), 2 norms."""
    per_layer = h * heads * hd * 2 + h * kv_heads * hd * 2 + 2 * hd + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


@pytest.mark.parametrize("tied", [True, False])
def test_weights_and_kv_read_once_per_step(tied):
    model = build_model(PolicyModelConfig(**SHAPE, tie_word_embeddings=tied), VocabOnly(1000))
    p = qwen3_params(1000, 64, 2, 4, 2, 16, 192, tied)
    assert sum(x.numel() for x in model.parameters()) == p  # the hand count is the model's
    read_weights = p - (0 if tied else 1000 * 64)  # an untied input table is only gathered from
    kv = 8 * 100 * 2 * 2 * 2 * 16  # batch x context x layers x (K and V) x kv heads x head_dim
    got = decode_bandwidth_limit(model, batch=8, context_len=100, dtype_bytes=2, bandwidth_bytes_per_s=1e12)
    assert got == pytest.approx(8 * 1e12 / ((read_weights + kv) * 2))


def test_qwen3_06b_at_batch_64_on_an_h200():
    """The issue's figure: Qwen3-0.6B, 64 x (512 + 128) tokens in bf16 at 4.8 TB/s is ~50k tokens/s."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):  # shapes only: no memory for 0.6B weights
        model = Qwen3ForCausalLM(cfg)
    weights = qwen3_params(151936, 1024, 28, 16, 8, 128, 3072, True) * 2
    kv = 64 * 640 * 28 * 2 * 8 * 128 * 2
    limit = decode_bandwidth_limit(model, batch=64, context_len=640, dtype_bytes=2, bandwidth_bytes_per_s=4.8e12)
    assert limit == pytest.approx(64 * 4.8e12 / (weights + kv))
    assert 45_000 < limit < 55_000
    # more context per row: the KV reads grow and the limit falls; a bigger batch amortises the weights
    longer, wider = (decode_bandwidth_limit(model, 64, 4096, 2, 4.8e12),
                     decode_bandwidth_limit(model, 128, 640, 2, 4.8e12))
    assert longer < limit < wider


def test_rejects_nonsense():
    model = build_model(PolicyModelConfig(**SHAPE), VocabOnly(100))
    with pytest.raises(ValueError):
        decode_bandwidth_limit(model, batch=0, context_len=10, dtype_bytes=2, bandwidth_bytes_per_s=1e12)
    with pytest.raises(ValueError):
        decode_bandwidth_limit(model, batch=1, context_len=10, dtype_bytes=2, bandwidth_bytes_per_s=0)
