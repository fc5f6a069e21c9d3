"""The device check of the one training loop under accelerate's FSDP2 engine (CUDA only; not collected by pytest):

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes N tests/training/fsdp2_worker.py OUT

On a GPU host, each check's outcome is printed and written to OUT/fsdp2.json (a failed check is recorded with its
error and the others still run). What it checks, on a tiny Qwen3 with every parameter a sharded DTensor:

* full fine-tuning through run_loop, stopped after a checkpoint (accelerate's save_state of the FSDP2 model and
  optimizer, renamed into place) and resumed by a second run_loop to the weights of an uninterrupted run;
* the published state dict (prorag.training.distributed.full_state_dict): full tensors on the main process, the
  plain model's keys and shapes, and a model loaded from it computes what the sharded one computes through
  call_in_engine (a forward pass outside the loop's steps);
* LoRA on a frozen bfloat16 base: trained under FSDP2, the adapter saved by PEFT from the gathered state dict;
* the FSDP2 run's loss against the same loop without an accelerator (mixed precision differs: close, not equal).
"""

import json
import sys
import threading
import traceback
from pathlib import Path

import torch


def tiny(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, tie_word_embeddings=False))


def batch_at(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(3, 256, (2, 16), generator=g)


def loss_fn(m, ids):
    return m(input_ids=ids, labels=ids).loss, ids.numel()


def main(out: str) -> None:
    from prorag.training.context import local_context
    from prorag.training.devices import Placement
    from prorag.training.distributed import (accelerator_from_env, check_engine, finish_distributed,
                                             full_state_dict, is_sharded)
    from prorag.training.loop import LoopConfig, call_in_engine, run_loop

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = accelerator_from_env()
    main_process = accelerator.is_main_process
    results: dict = {"processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
                     "fsdp2": bool(accelerator.is_fsdp2), "device": str(accelerator.device)}
    check_engine(accelerator)
    assert is_sharded(accelerator), "not launched with an FSDP config"
    placement = Placement(accelerator.device, torch.bfloat16, "sdpa")
    cfg = LoopConfig(steps=6, optimizer="adamw", lr=3e-3, schedule="warmup_cosine", warmup_steps=1,
                     grad_clip=1.0, grad_accum=2 * accelerator.num_processes, checkpoint_every=3, log_every=1)

    def check(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the other checks still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        if main_process:
            print(name, json.dumps(results[name], default=str)[:2000], flush=True)

    def train(work: Path, stop_at: int | None = None, model=None):
        model = model if model is not None else tiny().to(accelerator.device)
        stop = threading.Event()

        def emit(ev):
            if stop_at is not None and ev.get("loss") is not None and ev["step"] >= stop_at:
                stop.set()
        ctx = local_context(work, cfg, emit=emit, stop=stop) if main_process else \
            local_context(work.with_name(work.name + f"-rank{accelerator.process_index}"), cfg)
        ctx.shared_checkpoint_dir = work / "checkpoints"
        result = run_loop(ctx, model, batch_at, loss_fn, cfg, accelerator=accelerator, placement=placement)
        return model, result

    state = {}

    def published(model):
        # what a stage publishes: the gathered state dict (every process takes part), on the main process
        weights = full_state_dict(accelerator, model)
        return weights if weights is not None or not main_process else model.state_dict()

    def full_fine_tuning():
        _, stopped = train(out_dir / "resumed", stop_at=3)
        ckpts = sorted(p.name for p in (out_dir / "resumed" / "checkpoints").glob("step-*"))
        model, resumed = train(out_dir / "resumed")
        weights = published(model)
        straight_model, straight = train(out_dir / "straight")
        straight_weights = published(straight_model)
        state["model"], state["weights"] = model, weights
        if not main_process:
            return {}
        plain = tiny().state_dict()
        gap = max(float((weights[k].float() - straight_weights[k].float()).abs().max()) for k in weights)
        return {"stopped_completed": stopped.completed, "stopped_step": stopped.step, "checkpoints": ckpts,
                "checkpoint_files": sorted(p.name for p in (out_dir / "resumed" / "checkpoints" / ckpts[-1]).iterdir()),
                "resumed_loss": resumed.loss, "straight_loss": straight.loss, "resumed_vs_straight_max_diff": gap,
                "keys_match_plain_model": sorted(weights) == sorted(plain),
                "shapes_match": all(tuple(weights[k].shape) == tuple(plain[k].shape) for k in plain if k in weights),
                "dtensors_in_published": sum(type(v).__name__ == "DTensor" for v in weights.values()),
                "moved_from_init": max(float((weights[k].float().cpu() - plain[k]).abs().max()) for k in plain)}

    def engine_forward():
        model, weights = state["model"], state["weights"]
        ids = batch_at(99).to(accelerator.device)
        model.eval()
        with torch.no_grad(), placement.autocast():
            sharded = call_in_engine(model, lambda m: m(input_ids=ids).logits.float())
        if not main_process:
            return {}
        reloaded = tiny().to(accelerator.device)
        reloaded.load_state_dict({k: v.to(accelerator.device) for k, v in weights.items()})
        reloaded.eval()
        with torch.no_grad(), placement.autocast():
            full = reloaded(input_ids=ids).logits.float()
        return {"max_abs_diff": float((sharded - full).abs().max()), "logit_scale": float(full.abs().max())}

    def against_no_accelerator():
        model = tiny().to(accelerator.device)
        ctx = local_context(out_dir / f"plain-{accelerator.process_index}", cfg)
        plain = run_loop(ctx, model, batch_at, loss_fn, cfg, placement=placement)
        return {"plain_loss": plain.loss}

    def lora():
        from peft import LoraConfig, get_peft_model
        from safetensors.torch import load_file

        base = tiny().to(accelerator.device, torch.bfloat16).requires_grad_(False)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
        lcfg = LoopConfig(**{**cfg.__dict__, "checkpoint_every": 2, "steps": 4})
        ctx = local_context(out_dir / f"lora-{accelerator.process_index}", lcfg)
        ctx.shared_checkpoint_dir = out_dir / "lora-0" / "checkpoints"
        result = run_loop(ctx, model, batch_at, loss_fn, lcfg, accelerator=accelerator, placement=placement)
        weights = full_state_dict(accelerator, model)
        if not main_process:
            return {}
        model.save_pretrained(out_dir / "adapter", state_dict=weights)
        saved = load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))
        return {"loss": result.loss, "gathered_keys": len(weights),
                "gathered_lora_keys": sorted(k for k in weights if "lora_" in k)[:4],
                "gathered_sample": sorted(weights)[:3], "adapter_keys": sorted(saved)[:4],
                "lora_B_abs_max": max((float(v.abs().max()) for k, v in saved.items() if "lora_B" in k), default=None),
                "shapes": sorted({str(tuple(v.shape)) for v in saved.values()})}

    check("full_fine_tuning", full_fine_tuning)
    if "model" in state:
        check("engine_forward", engine_forward)
    check("lora", lora)
    if accelerator.num_processes == 1:
        check("against_no_accelerator", against_no_accelerator)
    if main_process:
        (out_dir / "fsdp2.json").write_text(json.dumps(results, indent=1, default=str))
    finish_distributed(accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
