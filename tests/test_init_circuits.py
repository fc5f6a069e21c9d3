"""The induction circuit wired in at init: the model copies before any training, and only because of it."""

import random

import pytest
import torch

from prorag.errors import InvalidArgument
from prorag import modeling as M
from prorag.init_circuits import wire_induction_circuit

from tests.conftest import VocabOnly


SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
             rope_theta=10_000.0)


def repeated_strings(n=32, length=8, seed=0):
    """[n, 5 + length + 7 + length]: noise, a random string, noise, the same string again."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = [rng.randrange(300, 2048) for _ in range(length)]
        rows.append([rng.randrange(300, 2048) for _ in range(5)] + s + [rng.randrange(300, 2048) for _ in range(7)] + s)
    return torch.tensor(rows)


def copy_accuracy(model, length=8):
    """Greedy next-token accuracy on the repeat (after its first token, which cannot be predicted)."""
    x = repeated_strings(length=length)
    start = 5 + length + 7
    with torch.no_grad():
        pred = model(x).logits[:, start:start + length - 1].argmax(-1)
    return float((pred == x[:, start + 1:start + length]).float().mean())


def test_induction_init_copies_before_training_and_normal_init_does_not():
    wired = M.build_model(M.PolicyModelConfig(**SHAPE, init="induction"), VocabOnly(2048))
    plain = M.build_model(M.PolicyModelConfig(**SHAPE), VocabOnly(2048))
    assert copy_accuracy(wired) > 0.8
    assert copy_accuracy(plain) < 0.05


def test_layer0_wired_heads_attend_to_the_previous_token():
    model = M.build_model(M.PolicyModelConfig(**SHAPE, init="induction"), VocabOnly(2048))
    model.config._attn_implementation = "eager"  # attention weights are only returned by eager attention
    x = repeated_strings(n=1, length=12)
    with torch.no_grad():
        att = model(x, output_attentions=True).attentions[0][0]  # [heads, T, T]
    group = SHAPE["num_heads"] // SHAPE["num_kv_heads"]
    prev = torch.stack([att[:group, t, t - 1] for t in range(1, x.shape[1])], dim=-1)
    assert prev.min() > 0.9


def test_induction_preset_is_wired_and_small_models_are_refused():
    assert M.PRESETS["cpu-induction"].init == "induction" and M.PRESETS["cpu"].init == "normal"
    too_small = M.build_model(M.PolicyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                                  head_dim=16, intermediate_size=64), VocabOnly(2048))
    with pytest.raises(ValueError, match="induction init needs"):
        wire_induction_circuit(too_small)
    with pytest.raises(ValueError, match="init"):
        M.model_config({"init": "clever"})
    with pytest.raises(InvalidArgument, match="induction init needs"):  # refused with the config
        M.model_config({"init": "induction", "num_layers": 1})
