"""`prorag bench sft`: training tokens/s and MFU of SFT steps through the one training loop."""

from __future__ import annotations

import statistics
import tempfile

from prorag.training.context import local_context
from prorag.trajectory import CHAT_TOKENS, TAGS
from prorag_app.bench.harness import machine, median_dicts
from prorag_app.bench.models import bench_model

#: share of an SFT sequence's positions that are trained (about a fifth of an agent trajectory: prompt, documents
#: and glue are masked), so the LM head runs on as many positions as in the sft stage
SFT_TRAINED_SHARE = 0.2


def bench_sft(args) -> dict:
    """SFT optimizer steps of a policy through the one training loop with the sft stage's loss, on synthetic
    sequences (batch x seq_len random ordinary tokens, a fifth of them trained): tokens/s and MFU against the
    measured peak matmul FLOP/s of the dtype used (--device / --dtype / --compile, as a stage's config takes them;
    auto = the first GPU in bf16, else the CPU in float32). Per repeat the first logging window (allocation,
    warm-up) is dropped."""
    import torch  # torch and the training loop: this bench alone, not `prorag bench`'s other targets

    from prorag.modeling import load_for_training, load_policy, num_parameters
    from prorag.training.devices import resolve
    from prorag.training.run_config import TrainRunConfig
    from prorag.training.flops import peak_matmul_flops
    from prorag.training.lm import weighted_lm_loss
    from prorag.training.loop import LoopConfig, run_loop
    placement = resolve(TrainRunConfig(device=args.device, dtype=args.dtype, fused_linear_ce=args.fused_ce))
    sum_ce = placement.sum_ce()
    model_dir = bench_model(args.world, args.model)
    vocab = len(load_policy(model_dir)[1])
    batch, seq_len, window = args.batch, args.seq_len, max(1, args.iters // 3)

    def batch_at(i: int):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(len(CHAT_TOKENS) + len(TAGS), vocab, (batch, seq_len), generator=g)
        trained = torch.rand(batch, seq_len, generator=g) < SFT_TRAINED_SHARE
        return ids, torch.ones_like(ids), ids.masked_fill(~trained, -100), trained.float()

    def loss_fn(m, b):
        ids, attn, labels, w = b
        return weighted_lm_loss(m, ids, attn, labels, w, sum_ce=sum_ce)[0], int(attn.sum())

    cfg = LoopConfig(steps=3 * window, optimizer="adamw", lr=1e-4, weight_decay=0.01, grad_clip=1.0,
                     checkpoint_every=3 * window, log_every=window, compile=args.compile)
    runs = []
    for _ in range(args.repeats):
        model = load_for_training(model_dir, placement)[0]  # fresh weights and optimizer for every repeat
        events: list[dict] = []
        with tempfile.TemporaryDirectory() as work:
            run_loop(local_context(work, cfg, emit=events.append), model, batch_at, loss_fn, cfg, placement=placement)
        later = [e for e in events if e.get("loss") is not None][1:]
        runs.append({"tokens_per_s": statistics.median(e["tokens_per_s"] for e in later),
                     "mfu": statistics.median(e["metrics"]["mfu"] for e in later)})
    return {"target": "sft", "model": model_dir, "num_parameters": num_parameters(model), "batch": batch,
            "seq_len": seq_len, "steps_per_repeat": 3 * window, "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "peak_matmul_flops": peak_matmul_flops(placement.device, placement.dtype),
            **placement.describe(), "compile": args.compile,
            "machine": machine(),
            **median_dicts(runs), "runs": runs}
