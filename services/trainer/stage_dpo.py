"""Stage "dpo": ReasonRAG's path from the same MCTS trees: preference pairs labelled by shortest-path reward
estimation (SPRE value margins, the MCTS stage's ``value_choice``), then DPO on the policy with LoRA.

A pair is two sibling steps under one context (prorag.pairs.StepPair). Its two sequences are the agent's
trajectory up to the context, then each step, tokenised as SFT tokenises a sample
(prorag.sft_data.encode_segments); DPO's log-probability of a step is the sum over the step's generated tokens
(its last span), the context and documents being the condition. The reference is the same model with the
adapter disabled, so it costs no second copy.

Why not TRL's DPOTrainer: it owns its training loop and tokenises prompt/completion text itself, while here the
step's ids must be the ids the policy produced and reads (documents and glue inserted between steps), and the
project's one loop gives checkpoints, exact resume, cancellation and the same events as every other stage.
The objective is TRL's (and ReasonRAG's) sigmoid loss with beta 0.3 (prorag.algorithms.rl.dpo_loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorag.config import cfg_field
from prorag.errors import FailedPrecondition
from prorag.training.context import JobContext
from services.trainer.stage_rl import ALL_PROJECTIONS
from services.trainer.stages import register_stage, resolve_model


@dataclass
class DPOConfig:
    """DPO with LoRA on labelled sibling steps (ReasonRAG: SPRE pairs from MCTS)."""

    world: str = cfg_field("default", help="embedded world whose adapter registry receives the adapter")
    pairs: str = cfg_field("", help="required: JSONL of sibling pairs (prorag.pairs.StepPair rows), e.g. the "
                                    "MCTS stage's output")
    base_model: str = cfg_field("", help="required: the policy the adapter trains on (a directory or name@version "
                                         "in the world's registry; ReasonRAG's baseline: the SFT model)")
    label_source: str = cfg_field("value", help="which label orders a pair: value (SPRE margin, ReasonRAG), judge "
                                                "(ProRAG's judge) or both (only where they agree)",
                                  choices=("judge", "value", "both"))
    beta: float = cfg_field(0.3, help="DPO beta (ReasonRAG: 0.3)", min=1e-4, max=100.0)
    epochs: float = cfg_field(1.0, help="passes over the pairs (ReasonRAG: 1)", min=0.01, max=100)
    batch_size: int = cfg_field(8, help="pairs per optimizer step", min=1, max=1024)
    lr: float = cfg_field(5e-4, help="peak learning rate of the LoRA weights (ReasonRAG: 1e-6, full fine-tuning "
                                     "of a 7B model; a LoRA on a small model takes more)", min=0.0, max=1.0)
    warmup_ratio: float = cfg_field(0.1, help="fraction of steps warming up (then cosine decay)", min=0.0, max=0.5)
    max_len: int = cfg_field(2048, help="pairs whose longer sequence exceeds this many tokens are skipped (and "
                                        "counted)", min=16)
    lora_r: int = cfg_field(16, help="LoRA rank", min=1, max=1024)
    lora_alpha: int = cfg_field(32, help="LoRA alpha", min=1, max=4096)
    lora_dropout: float = cfg_field(0.0, help="LoRA dropout", min=0.0, max=0.9)
    lora_targets: str = cfg_field(ALL_PROJECTIONS, help="comma-separated module names LoRA adapts")
    adapter_name: str = cfg_field("reasonrag", help="published as adapter_name@<job id> in the world's adapter "
                                                    "registry")
    seed: int = cfg_field(0, help="data order and LoRA init", min=0, max=2 ** 31 - 1)
    checkpoint_every: int = cfg_field(50, help="steps between checkpoints", min=1)
    log_every: int = cfg_field(10, help="steps between progress events", min=1)
    threads: int = cfg_field(0, help="torch threads (0 = leave as is)", min=0, max=256)
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default", choices=("", "wandb", "local"))


def encode_preference(tokenizer, pair, choice: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen ids, chosen step mask, rejected ids, rejected step mask) of ``pair`` with sibling ``choice`` chosen;
    a mask [T] is 1 on the sibling step's generated tokens, the tokens whose log-probability DPO compares."""
    from prorag.sft_data import agent_prompt, encode_segments

    out = []
    for i in (choice, 1 - choice):
        traj = encode_segments(tokenizer, agent_prompt(pair.question), [*pair.context, pair.steps[i]], {}, {})
        span = traj.spans[-1]
        mask = [0] * len(traj.token_ids)
        mask[span.generated] = [1] * (span.generated_end - span.start)
        out += [list(traj.token_ids), mask]
    return tuple(out)


def step_logps(model, sequences, pad_id: int):
    """[N] summed log-probabilities of each (ids, mask) sequence's masked tokens, in one padded forward pass."""
    import torch

    from services.trainer.stage_rl import token_logprobs

    T = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(sequences), T))
    for i, (s, m) in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    return (token_logprobs(model, ids, attn, mask) * mask).sum(-1)


def run_dpo(ctx: JobContext) -> dict:
    import torch

    from prorag.algorithms.rl import dpo_loss
    from prorag.modeling import load_policy
    from prorag.pairs import load_pairs
    from prorag.registry import ArtifactRef, registry, weights_sha256
    from prorag.training.loop import LoopConfig, run_loop, shuffled_epochs
    from services.trainer.stage_rl import build_lora, publish_adapter

    cfg: DPOConfig = ctx.config
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pairs = load_pairs(cfg.pairs)
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    ctx.seed_everything(cfg.seed)
    model, tokenizer = load_policy(base, device="cpu", dtype="float32")
    model = build_lora(model, cfg)
    data, too_long = [], 0
    for p in pairs:
        choice = p.label(cfg.label_source)
        if choice is None or p.steps[0].empty or p.steps[1].empty:
            continue
        c_ids, c_mask, r_ids, r_mask = encode_preference(tokenizer, p, choice)
        if max(len(c_ids), len(r_ids)) > cfg.max_len:
            too_long += 1
            continue
        data.append({"chosen": (c_ids, c_mask), "rejected": (r_ids, r_mask)})
    if not data:
        raise FailedPrecondition(f"no {cfg.label_source}-labelled pairs to train on in {cfg.pairs} "
                                 f"({len(pairs)} pairs read, {too_long} too long)")
    pad = tokenizer.pad_token_id
    # the reference log-probs: the same weights with the adapter disabled, computed once (a function of the data,
    # so a resumed job computes the same ones)
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        for i in range(0, len(data), cfg.batch_size):
            part = data[i:i + cfg.batch_size]
            ref = step_logps(model, [d["chosen"] for d in part] + [d["rejected"] for d in part], pad)
            for d, rc, rr in zip(part, ref[:len(part)].tolist(), ref[len(part):].tolist()):
                d["ref"] = (rc, rr)
    model.train()
    total, batch_at = shuffled_epochs(data, cfg.batch_size, cfg.epochs, cfg.seed)
    stats_sum = {"reward_accuracy": 0.0, "margin": 0.0, "n": 0}

    def loss_fn(m, batch):
        logps = step_logps(m, [d["chosen"] for d in batch] + [d["rejected"] for d in batch], pad)
        n = len(batch)
        ref = torch.tensor([d["ref"] for d in batch])
        loss, st = dpo_loss(logps[:n], logps[n:], ref[:, 0], ref[:, 1], beta=cfg.beta)
        stats_sum["reward_accuracy"] += st["reward_accuracy"] * n
        stats_sum["margin"] += st["margin"] * n
        stats_sum["n"] += n
        return loss, sum(len(d["chosen"][0]) + len(d["rejected"][0]) for d in batch)

    loop = LoopConfig(steps=total, optimizer="adamw", lr=cfg.lr, weight_decay=0.0, schedule="warmup_cosine",
                      warmup_steps=int(total * cfg.warmup_ratio), grad_clip=1.0, checkpoint_every=cfg.checkpoint_every,
                      log_every=cfg.log_every)
    result = run_loop(ctx, model, batch_at, loss_fn, loop)
    if not result.completed:
        return {}
    version = publish_adapter(model, cfg.world, cfg.adapter_name, ctx.job_id, base=base,
                              base_sha=weights_sha256(base), scratch=ctx.checkpoint_dir / "adapter-scratch",
                              config={"stage": "dpo", "job_id": ctx.job_id, **ctx.config_dict}, step=total)
    ref = ArtifactRef(cfg.adapter_name, version)
    n = max(stats_sum["n"], 1)
    return {"adapter": ref.key, "adapter_path": str(registry("adapter", cfg.world).path(ref)),
            "final_loss": result.loss, "train_pairs": len(data), "pairs_read": len(pairs), "too_long": too_long,
            "steps": total,
            # over the steps this attempt ran (a resumed job: since the resume)
            "reward_accuracy": stats_sum["reward_accuracy"] / n, "mean_margin": stats_sum["margin"] / n}


register_stage("dpo", DPOConfig, run_dpo,
               description="ReasonRAG's baseline: DPO with LoRA on sibling-step pairs ordered by SPRE value margins "
                           "(or the judge), the step's log-probability given its context; published as an adapter",
               checks={"base_model": "model", "adapter_name": "name"})
