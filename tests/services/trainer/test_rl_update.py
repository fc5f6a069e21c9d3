"""The RL update in length-sorted chunks: the same loss and gradient as one padded pass, with less padding; and
trajectories with zero advantage left out of the passes, with the same gradient."""

import random
from types import SimpleNamespace

import pytest
import torch

from prorag.config import from_dict
from prorag.modeling import load_policy
from prorag.training.devices import CPU_FP32
from prorag.training.lora import RLSample, build_lora, collate_rl, length_chunks, rl_loss, token_logprobs
from services.trainer.rl_update import micro_batches, policy_loss, recompute_old_logprobs
from services.trainer.stage_rl import RLConfig


def _lora_policy(model_dir, cfg):
    """The tiny policy under a LoRA adapter whose B is drawn (it starts at zero): the adapter changes the outputs."""
    torch.manual_seed(0)
    model = build_lora(load_policy(model_dir, device="cpu", dtype="float32")[0], cfg)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model


def _samples(tok, n_samples: int, seed: int, flat_every: int = 0) -> list[RLSample]:
    """Trajectories of random tokens, 20-120 long, ~60% generated; with flat_every k every k-th has advantage 0."""
    rng = random.Random(seed)
    samples = []
    for i in range(n_samples):
        n = rng.randint(20, 120)
        gen = [0] + [int(rng.random() < 0.6) for _ in range(n - 1)]  # position 0 is the prompt
        scale = 0.0 if flat_every and i % flat_every == 0 else None
        samples.append(RLSample([rng.randrange(5, len(tok) - 1) for _ in range(n)], gen,
                                [(rng.uniform(-1, 1) if scale is None else scale) * g for g in gen],
                                [float(g) for g in gen], [rng.uniform(-3, -0.1) * g for g in gen]))
    return samples


def test_length_chunks_sort_by_length_and_bound_the_padding():
    lengths = [900, 120, 300, 310, 1000, 200, 640]
    chunks = length_chunks(lengths, 1300)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))  # every sequence once
    flat = [lengths[i] for c in chunks for i in c]
    assert flat == sorted(lengths)  # shortest first
    assert all(len(c) * max(lengths[i] for i in c) <= 1300 or len(c) == 1 for c in chunks)
    assert length_chunks(lengths, 0) == [sorted(range(7), key=lambda i: lengths[i])]  # 0 = one pass
    assert length_chunks([5000], 100) == [[0]]  # too long for the budget: alone
    assert length_chunks([], 100) == []


def test_chunked_update_has_the_loss_and_gradient_of_one_pass(tiny_policy):
    model_dir, tok = tiny_policy
    cfg = from_dict(RLConfig, {"base_model": str(model_dir), "lora_r": 4, "lora_alpha": 8})
    model = _lora_policy(model_dir, cfg)
    samples = _samples(tok, 9, seed=0)
    pad = tok.pad_token_id

    def grads_of(chunks):
        model.zero_grad()
        results = [rl_loss(model, collate_rl([samples[i] for i in c], pad), cfg) for c in chunks]
        n = sum(st["tokens"] for _, st in results)
        loss = sum(l * (st["tokens"] / n) for l, st in results)
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    whole_loss, whole = grads_of([list(range(len(samples)))])
    chunks = length_chunks([len(s.token_ids) for s in samples], 240)
    assert len(chunks) > 2
    chunk_loss, chunked = grads_of(chunks)
    assert abs(whole_loss - chunk_loss) < 1e-5
    for k in whole:
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-4, atol=1e-6)


def test_trajectories_without_advantage_are_skipped_and_the_gradient_is_the_whole_batchs(tiny_policy):
    """Groups whose rollouts all earned one reward carry zero advantage: the update leaves them out of its forward
    passes, counts their tokens in the mean, and gets the gradient of the pass over every trajectory."""
    model_dir, tok = tiny_policy
    cfg = from_dict(RLConfig, {"base_model": str(model_dir), "lora_r": 4, "lora_alpha": 8, "mini_batches": 1,
                               "grad_accum": 2, "chunk_tokens": 240})
    model = _lora_policy(model_dir, cfg)
    samples = _samples(tok, 10, seed=1, flat_every=3)  # every third trajectory: a flat group's, advantage 0
    run = SimpleNamespace(cfg=cfg, tokenizer=tok, acc=None)

    def grads(loss_of):
        model.zero_grad()
        loss_of().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    whole = grads(lambda: rl_loss(model, collate_rl(samples, tok.pad_token_id), cfg)[0])
    (micro,) = micro_batches(run, samples)
    forwarded = sum(int(c[0].shape[0]) for part in micro for c in part[0])
    assert forwarded == 6  # the 4 flat trajectories are not forwarded
    skipped = grads(lambda: sum(policy_loss(run, model, part)[0] for part in micro) / cfg.grad_accum)
    for k in whole:
        torch.testing.assert_close(skipped[k], whole[k], rtol=1e-4, atol=1e-6)
    # a micro-batch of flat trajectories only: no forward, and a zero gradient (AdamW steps on), not None
    flat = [s for i, s in enumerate(samples) if i % 3 == 0]
    (micro,) = micro_batches(SimpleNamespace(cfg=cfg, tokenizer=tok, acc=None), flat)
    assert all(part[0] == [] for part in micro)
    zero = grads(lambda: sum(policy_loss(run, model, part)[0] for part in micro))
    assert zero and all(float(g.abs().max()) == 0.0 for g in zero.values())
    # with a KL term every trajectory has a gradient: none is skipped
    kl_run = SimpleNamespace(cfg=from_dict(RLConfig, {**{f: getattr(cfg, f) for f in ("base_model", "lora_r",
                                                       "lora_alpha", "mini_batches", "grad_accum", "chunk_tokens")},
                                                      "kl_coef": 0.05}), tokenizer=tok, acc=None)
    (micro,) = micro_batches(kl_run, samples)
    assert sum(int(c[0].shape[0]) for part in micro for c in part[0]) == 10


def test_tempered_log_probs_are_the_sampling_distribution_s_and_the_update_reads_them(tiny_policy):
    """With tempered_logprobs the recomputed old log-probs and the update's new ones are those of logits / T, the
    distribution a rollout at temperature T was drawn from (TRL's and verl's convention); off, the raw ones."""
    model_dir, tok = tiny_policy
    base = {"base_model": str(model_dir), "lora_r": 4, "lora_alpha": 8, "temperature": 0.5}
    tempered = from_dict(RLConfig, {**base, "tempered_logprobs": True, "recompute_old_logprobs": True})
    raw = from_dict(RLConfig, base)
    assert (tempered.logprob_temperature(), raw.logprob_temperature()) == (0.5, 1.0)
    model = _lora_policy(model_dir, raw)
    model.eval()
    (sample,) = _samples(tok, 1, seed=3)
    ids, attn, _, mask, _ = collate_rl([sample], tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[0, :-1].float()
        got = token_logprobs(model, ids, attn, mask, temperature=0.5)[0, 1:]
    want = torch.log_softmax(logits / 0.5, -1).gather(-1, ids[0, 1:, None])[:, 0] * mask[0, 1:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the recomputed old log-probs are the tempered ones, so before any step the ratio is 1 (no clipping)
    run = SimpleNamespace(cfg=tempered, model=model, tokenizer=tok, placement=CPU_FP32)
    recompute_old_logprobs(run, [sample])
    torch.testing.assert_close(torch.tensor(sample.old_logprobs)[1:], want, rtol=1e-5, atol=1e-5)
    _, stats = rl_loss(model, collate_rl([sample], tok.pad_token_id), tempered)
    assert stats["clip_fraction"] == 0.0 and abs(stats["approx_kl"]) < 1e-6
    # read raw, the same old log-probs are off by the temperature: the ratio leaves the clip range
    _, stats = rl_loss(model, collate_rl([sample], tok.pad_token_id), raw)
    assert stats["clip_fraction"] > 0.2
