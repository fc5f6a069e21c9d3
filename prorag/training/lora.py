"""LoRA adapters and per-token log-probabilities: what the adapter stages (RL, DPO) and `prorag bench rl` share.

Pure functions of a model and tensors (plus :func:`publish_adapter`, which writes to a world's adapter
registry); the stages keep their own orchestration. A config passed to :func:`build_lora` or :func:`rl_loss`
is any object with the named fields (the stages' RLConfig, DPOConfig).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from prorag.algorithms import lookup
from prorag.errors import AlreadyExists
from prorag.registry import ArtifactRef, registry

#: every attention and MLP projection of a decoder block (the default LoRA targets)
ALL_PROJECTIONS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def build_lora(model, cfg):
    """``model`` wrapped in a PEFT LoRA adapter from cfg.lora_r, lora_alpha, lora_dropout and lora_targets
    (comma-separated module names); the base weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def publish_adapter(model, world: str, name: str, version: str, *, base: Path, base_sha: str, scratch: Path,
                    config: dict, step: int, state_dict: dict | None = None) -> str:
    """Save the LoRA weights and publish them as name@version (or name@version.r<k> when a killed attempt left
    a different version under that name); returns the version published.

    state_dict: the PEFT model's full state dict gathered from a launch's shards (FSDP:
    prorag.training.distributed.full_state_dict), from which PEFT's save takes the adapter's weights; None = the
    model's own (one process, or DDP's replicated weights)."""
    adapters = registry("adapter", world)
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        if state_dict is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=state_dict)
        candidate, k = version, 0
        while True:
            try:
                adapters.publish(tmp, ArtifactRef(name, candidate), base_model=str(base), base_model_sha256=base_sha,
                                 config=config, step=step)
                return candidate
            except AlreadyExists:
                k += 1
                candidate = f"{version}.r{k}"


@dataclass
class RLSample:
    """One kept trajectory, ready for the loss; the per-token lists are aligned, each [T]."""

    token_ids: list[int]
    generated_mask: list[int]
    advantages: list[float]
    loss_mask: list[float]
    old_logprobs: list[float]
    question_id: str = ""
    reward: float = 0.0
    lag: int = 0


def collate_rl(samples: list[RLSample], pad_id: int):
    """[B] samples -> ids [B,T] (long), attention [B,T] (long), advantages, loss mask, old log-probs [B,T]."""
    import torch

    T = max(len(s.token_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    adv, mask, old = (torch.zeros((B, T)) for _ in range(3))
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        attn[i, :n] = 1
        adv[i, :n] = torch.tensor(s.advantages)
        mask[i, :n] = torch.tensor(s.loss_mask)
        old[i, :n] = torch.tensor(s.old_logprobs)
    return ids, attn, adv, mask, old


def length_chunks(lengths: list[int], max_padded: int) -> list[list[int]]:
    """Indices [N] grouped into chunks, shortest first, each padding to at most ``max_padded`` tokens
    (len(chunk) x its longest); a sequence longer than that is a chunk of its own; 0 = one chunk.

    Why: one forward pass over a whole iteration pads every trajectory to the longest (~200 to ~1,000 tokens);
    a token-weighted sum over length-sorted chunks is the same loss with a fraction of the padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not max_padded:
        return [order] if order else []
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * lengths[i] <= max_padded:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def token_logprobs(model, ids, attn, mask, temperature: float = 1.0):
    """log pi(ids[t] | ids[<t]) at the positions where mask [B,T] is set, 0 elsewhere -> [B,T].

    The LM head runs on the masked positions only (the generated tokens, a fraction of a trajectory), as the SFT
    loss does. Raw log-probs (temperature 1) by default, as the policy engines return them
    (services/policy/engine.py), so the ratio to the sampling log-probs compares like with like; ``temperature``:
    those of the tempered distribution (logits / temperature), the one a rollout sampled at that temperature
    was drawn from."""
    import torch

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = hf.get_output_embeddings().weight.device
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    hidden = hf.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [B,T,H]
    sel = mask[:, 1:] > 0  # position t-1 predicts token t; position 0 is the prompt
    logits = hf.get_output_embeddings()(hidden[:, :-1][sel]).float()  # [N,V]
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(ids.shape, dtype=lp.dtype, device=lp.device)
    out[:, 1:][sel] = lp
    return out


def rl_loss(model, batch, cfg):
    """The policy loss cfg.policy_loss (algorithms.rl.POLICY_LOSSES; the clipped surrogate by default, clipped at
    cfg.clip), plus k3 KL to the base when cfg.kl_coef > 0 (the adapter disabled), of one collate_rl batch;
    (loss scalar, stats: clip_fraction, approx_kl, kl, tokens)."""
    import torch  # torch and the losses (which load it): only when a loss is computed, as elsewhere in this module

    from prorag.algorithms.rl import POLICY_LOSSES

    loss_fn = lookup(POLICY_LOSSES, "policy loss", cfg.policy_loss)
    ids, attn, adv, mask, old = batch
    temperature = cfg.logprob_temperature()
    lp = token_logprobs(model, ids, attn, mask, temperature)
    ref = None
    if cfg.kl_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = token_logprobs(model, ids, attn, mask, temperature)
    return loss_fn(lp, old, adv, mask, clip=cfg.clip, kl_coef=cfg.kl_coef, ref_logprobs=ref)


__all__ = ["ALL_PROJECTIONS", "RLSample", "build_lora", "collate_rl", "length_chunks", "publish_adapter", "rl_loss",
           "token_logprobs"]
