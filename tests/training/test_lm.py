"""The causal-LM loss of a batch (prorag.training.lm): the head on trained positions only, and the same loss when
the head and cross-entropy are handed to a fused kernel's signature (liger-kernel's on a GPU; here the reference
implementation of that signature, since liger-kernel's Triton kernel needs CUDA)."""

from __future__ import annotations

import builtins

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from prorag.algorithms.losses import linear_ce_sum
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.training import lm
from prorag.training.devices import Placement
from prorag.training.lm import weighted_lm_loss


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float().train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0  # a right-padded row
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :3] = -100  # the prompt is not trained
    weights = torch.ones(2, 10)
    weights[:, 5] = 2.0  # a tag's weight, as the format-aware loss has them
    return ids, attn, labels, weights


def test_the_loss_through_a_fused_kernels_signature_equals_the_plain_head_in_value_and_gradients(model):
    plain, n = weighted_lm_loss(model, *batch())
    plain_grads = torch.autograd.grad(plain, list(model.parameters()), allow_unused=True)
    fused, n_fused = weighted_lm_loss(model, *batch(), sum_ce=linear_ce_sum)
    fused_grads = torch.autograd.grad(fused, list(model.parameters()), allow_unused=True)
    assert n == n_fused == 11  # trained labels: positions 3-9 of row 0, 3-6 of row 1 (padding from 7 on)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
    for got, want in zip(fused_grads, plain_grads):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.allclose(got, want, atol=1e-6)


def test_a_head_with_a_bias_is_refused_for_the_fused_kernel(model):
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    try:
        with pytest.raises(InvalidArgument, match="has a bias"):
            weighted_lm_loss(model, *batch(), sum_ce=linear_ce_sum)
    finally:
        head.bias = None


def test_a_placement_that_asks_for_the_fused_kernel_without_liger_kernel_says_how_to_get_it(monkeypatch):
    real_import = builtins.__import__

    def no_liger(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise ImportError("No module named 'liger_kernel'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    with pytest.raises(FailedPrecondition, match="needs liger-kernel"):
        Placement(torch.device("cuda", 0), torch.bfloat16, "sdpa", fused_linear_ce=True).sum_ce()
    with pytest.raises(FailedPrecondition, match="needs liger-kernel"):
        lm.fused_linear_ce_sum()
