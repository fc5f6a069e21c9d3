"""Run by tests/training/test_distributed.py, alone or under `accelerate launch --cpu --num_processes 2`: the one
training loop on a tiny Qwen3 causal LM with a deterministic batch_at(i), the final weights saved by the main
process to argv[1]/weights.pt."""

import sys
from pathlib import Path

import torch


def main(out: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prorag.training.context import local_context
    from prorag.training.distributed import accelerator_from_env, finish_distributed
    from prorag.training.loop import LoopConfig, run_loop

    torch.set_num_threads(1)
    accelerator = accelerator_from_env(cpu=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64))

    def batch_at(i: int):
        g = torch.Generator().manual_seed(1000 + i)  # a pure function of i, whichever process asks
        ids = torch.randint(3, 96, (2, 12), generator=g)
        return ids

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss, ids.numel()

    cfg = LoopConfig(steps=6, optimizer="adamw", lr=3e-3, schedule="warmup_cosine", warmup_steps=1, grad_clip=1.0,
                     grad_accum=4, checkpoint_every=3, log_every=1)
    work = Path(out) / "work"
    ctx = local_context(work, cfg, emit=lambda e: None)
    result = run_loop(ctx, model, batch_at, loss_fn, cfg, accelerator=accelerator)
    if accelerator is None or accelerator.is_main_process:
        torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "loss": result.loss, "processes": 1 if accelerator is None else accelerator.num_processes},
                   Path(out) / "weights.pt")
    finish_distributed(accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
