"""The update step of an RL iteration (services.trainer.stage_rl): ``mini_batches`` optimizer steps of the house
training loop (prorag.training.loop.TrainingLoop) on the iteration's samples, each of cfg.policy_loss
(prorag.training.lora.rl_loss: the clipped surrogate by default) with the sampling log-probs the policy service
returned as the old policy (or ones recomputed locally), and an optional k3 KL to the base. Every process of a
launch takes part, each on its share of the micro-batches."""

from __future__ import annotations

import time
from functools import partial

import torch

from prorag.algorithms.rl import adds_policy_gradient
from prorag.training.distributed import sum_over_processes
from prorag.training.lora import RLSample, collate_rl, length_chunks, rl_loss, token_logprobs
from prorag.training.loop import LoopConfig, call_in_engine
from services.trainer.rl_run import IterationData, RLRun

#: the loss statistics an update sums over its micro-batches (token-weighted) and its processes
_SUMMED = ("clip_fraction", "approx_kl", "kl", "tokens")


def loop_config(run: RLRun) -> LoopConfig:
    """The training loop's settings: one optimizer step per mini-batch, checkpoints and progress events counted
    in iterations; a constant learning rate (ProRAG's)."""
    cfg, m = run.cfg, run.cfg.mini_batches
    return cfg.loop_config(run.total * m, schedule="constant", beta2=0.999, grad_accum=cfg.grad_accum,
                           checkpoint_every=cfg.checkpoint_every * m, log_every=cfg.log_every * m)


def recompute_old_logprobs(run: RLRun, samples: list[RLSample]) -> None:
    """Replace the sampling log-probs with the local model's, before the update (recompute_old_logprobs: when the
    engine's numerics differ). Every process of a launch computes them all (under FSDP each forward is a
    collective)."""
    model = run.model
    model.eval()
    with torch.no_grad(), run.placement.autocast():
        for s in samples:
            batch = collate_rl([s], run.tokenizer.pad_token_id)
            s.old_logprobs = call_in_engine(model, partial(_sample_logprobs, batch,
                                                           run.cfg.logprob_temperature()))[0].tolist()
    model.train()


def _sample_logprobs(batch, temperature, model):
    return token_logprobs(model, batch[0], batch[1], batch[3], temperature)


def micro_batches(run: RLRun, samples: list[RLSample]) -> list[list]:
    """[m mini-batches (optimizer steps)][k micro-batches]: each (collated length chunks, scale), or None when
    it holds no trained token; the scale makes a step's gradient that of the token mean over its mini-batch.
    Trajectories that add no gradient (algorithms.rl.adds_policy_gradient: every advantage 0 and no KL term) are
    left out of the chunks but counted in the mean, so the gradient is the whole mini-batch's; a micro-batch left
    with none of its trajectories has no chunks, and gives a zero gradient (policy_loss), as its forward would."""
    cfg = run.cfg
    m_steps, k = cfg.mini_batches, cfg.grad_accum
    steps = []
    for mb in range(m_steps):
        share = samples[mb::m_steps]
        n_share = sum(sum(s.loss_mask) for s in share)
        micro = []
        for j in range(k):
            part = share[j::k]
            if not part or not sum(sum(s.loss_mask) for s in part):
                micro.append(None)
                continue
            live = [s for s in part if adds_policy_gradient(s.advantages, s.loss_mask, cfg.kl_coef)]
            n_live = sum(sum(s.loss_mask) for s in live)
            chunks = [collate_rl([live[i] for i in c], run.tokenizer.pad_token_id)
                      for c in length_chunks([len(x.token_ids) for x in live], cfg.chunk_tokens)]
            micro.append((chunks, k * n_live / n_share))
        steps.append(micro)
    return steps


def policy_loss(run: RLRun, model, batch):
    """(scaled loss, tokens, stats) of one micro-batch; stats are token-weighted sums for the journal."""
    if batch is None:
        if run.acc is not None:
            # on a launch the engine averages every adapter weight's gradient over the processes, so each must
            # give one: a forward of one token, times 0 (drop_grads drops a step with no data at all)
            ids = torch.full((1, 2), run.tokenizer.pad_token_id, dtype=torch.long)
            return token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0]])).sum() * 0.0, 0
        # nothing kept for this micro-batch: a loss with no path to the weights leaves their gradients None,
        # so AdamW skips them rather than stepping on stale momentum
        return torch.zeros((), requires_grad=True), 0
    chunks, scale = batch
    if not chunks:
        # every trajectory here has zero advantage (micro_batches): the gradient its forward would give, exactly
        # zero, without the forward; zero, not None, so AdamW steps on as it would have
        zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        return zero, 0, dict.fromkeys(("clip_fraction", "approx_kl", "kl", "tokens"), 0.0)
    # the micro-batch's token mean as the token-weighted sum of its chunks' token means
    results = [rl_loss(model, c, run.cfg) for c in chunks]
    n = sum(st["tokens"] for _, st in results)
    loss = sum(l * (st["tokens"] / n) for l, st in results)
    stats = {key: sum(st[key] * st["tokens"] for _, st in results) for key in ("clip_fraction", "approx_kl", "kl")}
    stats["tokens"] = n
    return loss * scale, int(sum(c[1].sum() for c in chunks)), stats


def drop_grads(model) -> None:
    # a step with no data on a launch: its zero gradients dropped, so AdamW skips it as on one process
    for p in model.parameters():
        p.grad = None


def _micro_batch_at(micro: list, k: int, i: int):
    # micro-batch i of a step is micro[i % k]: a pure function of i, as the loop needs
    return micro[i % k]


def update(run: RLRun, iteration: int, data: IterationData) -> dict | None:
    """The iteration's optimizer steps (its m mini-batches; a job resumed inside it does those left), summed
    statistics over every process; None when the job stops part-way (the loop saved its checkpoint)."""
    loop, m_steps, k = run.loop, run.cfg.mini_batches, run.cfg.grad_accum
    micro = micro_batches(run, data.samples)
    t0 = time.monotonic()
    first = loop.step - iteration * m_steps
    sums = dict.fromkeys(_SUMMED, 0.0)
    for mb in range(first, m_steps):
        # the stop check before the iteration's first step was made before its rollouts
        if mb > first and loop.stop_requested():
            return None
        empty = run.acc is not None and all(x is None for x in micro[mb])
        got = loop.train_step(partial(_micro_batch_at, micro[mb], k), grad_hook=drop_grads if empty else None)
        for key in _SUMMED:
            sums[key] += got.stats.get(key, 0.0)
    # each process of a launch accumulated its share of the micro-batches
    sums = dict(zip(_SUMMED, sum_over_processes(run.acc, [sums[key] for key in _SUMMED])))
    n = max(sums["tokens"], 1.0)
    # trajectories whose zero advantage left them out of the forward passes (micro_batches)
    skipped = sum(1 for s in data.samples if not adds_policy_gradient(s.advantages, s.loss_mask, run.cfg.kl_coef))
    return {"clip_fraction": sums["clip_fraction"] / n, "approx_kl": sums["approx_kl"] / n, "kl": sums["kl"] / n,
            "update_s": time.monotonic() - t0, "update_skipped": skipped}
