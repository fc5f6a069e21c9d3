"""`prorag bench rl`: one RL update in one padded pass against length-sorted chunks, and where the last
`prorag run`'s RL iterations spent their time."""

from __future__ import annotations

import json
import random
import statistics
import time

from prorag import paths
from prorag.config import from_dict
from prorag.data.sft import agent_prompt
from prorag.training.lora import RLSample, build_lora, collate_rl, length_chunks, rl_loss
from prorag_app.bench.models import bench_model


def _trajectory_lengths(tokenizer, limit: int = 500) -> list[int]:
    """Token lengths of the agent's greedy test trajectories that the last `prorag run` saved (prompt
    included); empty when there are none."""
    path = paths.runs_dir() / "latest" / "sft" / "predictions.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines()[:limit]:
        r = json.loads(line)
        text = agent_prompt(r["question"]) + (r.get("trajectory") or {}).get("text", "")
        out.append(len(tokenizer.encode(text, add_special_tokens=False)))
    return out


#: the parts of one RL iteration, as the RL stage's summary names their medians (prorag_app.stage34.rl_summary)
RL_STEP_PARTS = ("rollout", "prm_scoring", "reward", "update", "adapter_sync")


def rl_step_split(results: dict) -> dict:
    """Per RL method of a run's results.json: the median seconds of each part of an iteration (RL_STEP_PARTS) and
    each part's share of their sum; {} when the run trained no RL method."""
    out = {}
    for method, summary in (((results.get("stage34") or {}).get("rl")) or {}).items():
        parts = {p: float(summary.get(f"median_{p}_s", 0.0)) for p in RL_STEP_PARTS}
        total = sum(parts.values())
        out[method] = {**{f"{p}_s": v for p, v in parts.items()}, "iteration_s": total,
                       **{f"{p}_share": (v / total if total else 0.0) for p, v in parts.items()}}
    return out


def bench_rl(args) -> dict:
    """One RL update (the clipped loss's forward and backward through a LoRA policy) over a GRPO iteration's
    trajectories (--questions x --samples): one padded pass against length-sorted chunks of at most the stage's
    chunk_tokens padded tokens (prorag.training.lora.length_chunks; the same gradient). Lengths are drawn from
    the agent's saved test trajectories (uniform 200-1,000 tokens without them); token ids are random. Also the
    last `prorag run`'s RL iterations split into rollout, PRM scoring, reward, update and adapter sync
    (rl_step_split)."""
    import torch

    from prorag.modeling import load_policy
    from services.trainer.stage_rl import RLConfig

    model_dir = bench_model(args.world, args.model)
    model, tok = load_policy(model_dir)
    cfg = from_dict(RLConfig, {"base_model": model_dir})
    model = build_lora(model, cfg)
    pool = _trajectory_lengths(tok)
    rng = random.Random(0)
    n = args.questions * args.samples
    lengths = [rng.choice(pool) if pool else rng.randint(200, 1000) for _ in range(n)]
    samples = []
    for length in lengths:
        gen = [0] * 60 + [int(rng.random() < 0.5) for _ in range(length - 60)]
        samples.append(RLSample([rng.randrange(100, len(tok) - 1) for _ in range(length)], gen,
                                [rng.uniform(-1, 1) * g for g in gen], [float(g) for g in gen],
                                [-1.0 * g for g in gen]))

    def update(chunks) -> float:
        t = time.perf_counter()
        model.zero_grad()
        results = [rl_loss(model, collate_rl([samples[i] for i in c], tok.pad_token_id), cfg) for c in chunks]
        total = sum(st["tokens"] for _, st in results)
        sum(l * (st["tokens"] / total) for l, st in results).backward()
        return time.perf_counter() - t

    plans = {"one_pass": length_chunks(lengths, 0), "chunked": length_chunks(lengths, cfg.chunk_tokens)}
    out = {}
    for name, chunks in plans.items():
        times = [update(chunks) for _ in range(args.repeats)]
        out[name] = {"s": statistics.median(times), "chunks": len(chunks),
                     "padded_tokens": sum(len(c) * max(lengths[i] for i in c) for c in chunks)}
    latest = paths.runs_dir() / "latest" / "results.json"
    # where an iteration's time goes in the real RL jobs of the last `prorag run` (medians over their iterations)
    split = rl_step_split(json.loads(latest.read_text())) if latest.is_file() else {}
    return {"target": "rl", "model": model_dir, "trajectories": n, "tokens": sum(lengths),
            "step_split": split, "step_split_from": str(latest) if split else None,
            "lengths_from": "saved agent trajectories" if pool else "uniform 200-1000",
            "chunk_tokens": cfg.chunk_tokens, "threads": torch.get_num_threads(), "repeats": args.repeats, **out,
            "ratio": out["one_pass"]["s"] / out["chunked"]["s"]}
