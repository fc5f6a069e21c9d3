"""Stage "dpo": ReasonRAG's path from the same MCTS trees: preference pairs labelled by shortest-path reward
estimation (SPRE value margins, the MCTS stage's ``value_choice``), then DPO on the policy with LoRA.

A pair is two sibling steps under one context (prorag.search.pairs.StepPair). Its two sequences are the agent's
trajectory up to the context, then each step, tokenised as SFT tokenises a sample
(prorag.data.sft.encode_segments); DPO's log-probability of a step is the sum over the step's generated tokens
(its last span), the context and documents being the condition. The reference is the same model with the
adapter disabled, so it costs no second copy.

TRL does the data side: each pair becomes TRL's pre-tokenised preference example (prompt_ids, chosen_ids,
rejected_ids) and TRL's DataCollatorForPreference pads the chosen and rejected sequences into one batch with the
completion mask DPO sums over. Why not TRL's DPOTrainer as a whole: it owns its training loop, while the project's
one loop gives checkpoints, exact resume, cancellation and the same events as every other stage. The objective is
TRL's (and ReasonRAG's) sigmoid loss with beta 0.3 (prorag.algorithms.rl.dpo_loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorag.algorithms.rl import dpo_loss
from prorag.config import ConfigError, cfg_field
from prorag.data.sft import agent_prompt, encode_segments
from prorag.errors import FailedPrecondition
from prorag.modeling import load_for_training
from prorag.registry import ArtifactRef, registry, weights_sha256
from prorag.search.pairs import load_pairs
from prorag.training.context import JobContext
from prorag.training.distributed import full_state_dict, gather_lists, sum_over_processes
from prorag.training.loop import accumulated_epochs, run_loop
from prorag.training.lora import ALL_PROJECTIONS, build_lora, publish_adapter, token_logprobs
from prorag.training.run_config import TrainRunConfig
from services.trainer.stages import register_stage, resolve_model


@dataclass
class DPOConfig(TrainRunConfig):
    """DPO with LoRA on labelled sibling steps (ReasonRAG: SPRE pairs from MCTS)."""

    world: str = cfg_field("default", help="embedded world whose adapter registry receives the adapter")
    pairs: str = cfg_field("", help="required: JSONL of sibling pairs (prorag.search.pairs.StepPair rows), e.g. the "
                                    "MCTS stage's output")
    base_model: str = cfg_field("", help="required: the policy the adapter trains on (a directory or name@version "
                                         "in the world's registry; ReasonRAG's baseline: the SFT model)")
    label_source: str = cfg_field("value", help="which label orders a pair: value (SPRE margin, ReasonRAG), judge "
                                                "(ProRAG's judge) or both (only where they agree)",
                                  choices=("judge", "value", "both"))
    beta: float = cfg_field(0.3, help="DPO beta (ReasonRAG: 0.3)", min=1e-4, max=100.0)
    epochs: float = cfg_field(1.0, help="passes over the pairs (ReasonRAG: 1)", min=0.01, max=100)
    batch_size: int = cfg_field(8, help="pairs per optimizer step", min=1, max=1024)
    grad_accum: int = cfg_field(1, help="micro-batches each step's pairs are split into (a launch on several "
                                        "processes needs a multiple of their count)", min=1, max=1024)
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

    def validate(self) -> None:
        super().validate()
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")


def encode_preference(tokenizer, pair, choice: int) -> dict[str, list[int]]:
    """TRL's pre-tokenised preference example for ``pair`` with sibling ``choice`` chosen: ``prompt_ids`` the agent
    prompt and the context steps with their documents and glue, as the policy read them; ``chosen_ids`` and
    ``rejected_ids`` the sibling steps' generated tokens, the ones whose log-probability DPO compares (the glue
    after a step is left out: it conditions nothing before it)."""
    out: dict[str, list[int]] = {}
    for key, i in (("chosen_ids", choice), ("rejected_ids", 1 - choice)):
        traj = encode_segments(tokenizer, agent_prompt(pair.question), [*pair.context, pair.steps[i]], {}, {})
        span = traj.spans[-1]
        ids = list(traj.token_ids)
        prompt = ids[:span.start]
        if out.setdefault("prompt_ids", prompt) != prompt:
            raise ValueError(f"pair {pair.question_id}: its siblings' contexts encode differently")
        out[key] = ids[span.start:span.generated_end]
    return out


def preference_logps(model, collator, examples: list[dict]):
    """([B] chosen, [B] rejected) summed log-probabilities of each example's completion, in one padded forward pass
    over the batch TRL's collator makes (chosen rows first, then rejected)."""
    batch = collator([{k: e[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for e in examples])
    mask = batch["completion_mask"].float()
    logps = (token_logprobs(model, batch["input_ids"], batch["attention_mask"], mask) * mask).sum(-1)
    return logps[:len(examples)], logps[len(examples):]


def run_dpo(ctx: JobContext) -> dict:
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference


    cfg: DPOConfig = ctx.config
    cfg.apply_threads()
    placement = cfg.placement()
    pairs = load_pairs(cfg.pairs)
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    ctx.seed_everything(cfg.seed)
    # the base is frozen under the adapter: stored in the compute dtype, the LoRA weights in float32
    model, tokenizer = load_for_training(base, placement, frozen=True,
                                         gradient_checkpointing=cfg.gradient_checkpointing)
    model = build_lora(model, cfg)
    data, too_long = [], 0
    for p in pairs:
        choice = p.label(cfg.label_source)
        if choice is None or p.steps[0].empty or p.steps[1].empty:
            continue
        example = encode_preference(tokenizer, p, choice)
        if len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"])) > cfg.max_len:
            too_long += 1
            continue
        data.append(example)
    if not data:
        raise FailedPrecondition(f"no {cfg.label_source}-labelled pairs to train on in {cfg.pairs} "
                                 f"({len(pairs)} pairs read, {too_long} too long)")
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    # the reference log-probs: the same weights with the adapter disabled, computed once (a function of the data,
    # so a resumed job computes the same ones). On a launch each process computes every world-th batch (the model
    # is not sharded yet) and they exchange them: the same batches, so the same values, as one process.
    acc = ctx.accelerator
    rank, world = (acc.process_index, acc.num_processes) if acc is not None else (0, 1)
    model.eval()
    mine = []
    with torch.no_grad(), model.disable_adapter(), placement.autocast():
        for i in range(rank * cfg.batch_size, len(data), world * cfg.batch_size):
            chosen, rejected = preference_logps(model, collator, data[i:i + cfg.batch_size])
            mine.append((i, list(zip(chosen.tolist(), rejected.tolist()))))
    for i, refs in (x for part in gather_lists(acc, mine) for x in part):
        for d, ref in zip(data[i:i + cfg.batch_size], refs):
            d["ref"] = tuple(ref)
    model.train()
    total, batch_at = accumulated_epochs(data, cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.seed)
    stats_sum = {"reward_accuracy": 0.0, "margin": 0.0, "n": 0}

    def loss_fn(m, batch):
        chosen, rejected = preference_logps(m, collator, batch)
        n = len(batch)
        ref = torch.tensor([d["ref"] for d in batch], device=chosen.device)
        loss, st = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=cfg.beta)
        stats_sum["reward_accuracy"] += st["reward_accuracy"] * n
        stats_sum["margin"] += st["margin"] * n
        stats_sum["n"] += n
        return loss, sum(2 * len(d["prompt_ids"]) + len(d["chosen_ids"]) + len(d["rejected_ids"]) for d in batch)

    result = run_loop(ctx, model, batch_at, loss_fn, cfg.loop_config(total, grad_accum=cfg.grad_accum),
                      placement=placement)
    if not result.completed:
        return {}
    # each process of a launch saw its share of the pairs
    stats_sum["reward_accuracy"], stats_sum["margin"], stats_sum["n"] = sum_over_processes(
        acc, [stats_sum["reward_accuracy"], stats_sum["margin"], float(stats_sum["n"])])
    weights = full_state_dict(acc, model)  # every process of a launch takes part in the gather
    if not ctx.is_main:  # the other processes of a launch publish nothing
        return {}
    version = publish_adapter(model, cfg.world, cfg.adapter_name, ctx.job_id, base=base,
                              base_sha=weights_sha256(base), scratch=ctx.checkpoint_dir / "adapter-scratch",
                              config={"stage": "dpo", "job_id": ctx.job_id, **ctx.config_dict}, step=total,
                              state_dict=weights)
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
