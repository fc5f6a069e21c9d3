"""How fast the policy decodes against what its model allows: the engine's tokens/s against the bare batched
forward pass of the same model, and decoding with an RL-shaped adapter as PEFT layers against a merged copy."""

from __future__ import annotations

import statistics
import tempfile
import time

from prorag.engine import SamplingSpec
from prorag.trajectory import render_prompt
from prorag_app.bench.models import random_lora


def bare_decode_tokens_per_s(model, prompts: list[list[int]], new_tokens: int, pad_id: int, seed: int = 0) -> float:
    """The limit an engine's decoding reaches on this machine: the same model's batched forward passes alone
    (left-padded prefill of each distinct prompt once, its cache copied to the rows that share it, then
    ``new_tokens`` one-token steps for every row with a DynamicCache and plain multinomial sampling at temperature
    1: no stops, no per-sequence bookkeeping). Generated tokens per second, prefill included, as the engine's figure
    is. Every row decodes all ``new_tokens``, while an engine drops rows that stopped, so an engine whose samples
    stop early can beat this figure per token generated."""
    import torch
    from transformers import DynamicCache

    B = len(prompts)
    device = next(model.parameters()).device
    uniq = list(dict.fromkeys(tuple(p) for p in prompts))  # each distinct prompt prefilled once, as an engine does
    where = {p: i for i, p in enumerate(uniq)}
    expand = torch.tensor([where[tuple(p)] for p in prompts], dtype=torch.long, device=device)
    L = max(len(p) for p in uniq)
    ids = torch.full((len(uniq), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(uniq), L), dtype=torch.long)
    for i, p in enumerate(uniq):
        ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    g = torch.Generator(device).manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1, :].float()
        cache.reorder_cache(expand)
        logits, attn, next_pos = logits[expand], attn[expand], pos[expand, -1] + 1
        for _ in range(new_tokens):
            tok = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)  # [B, 1]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
            logits = model(input_ids=tok, attention_mask=attn, position_ids=next_pos[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1, :].float()
            next_pos = next_pos + 1
    sync()
    return B * new_tokens / (time.perf_counter() - t0)


def bench_decode(engine, questions, batch: int, new_tokens: int, repeats: int) -> dict:
    """The engine's decode tokens/s against the bare batched forward pass of the same model at the same batch
    size (bare_decode_tokens_per_s), on ``batch`` first-step prompts of the test questions; medians."""
    # a GRPO batch decodes G samples of each prompt: the same prompts repeated, as the rollout's first step does
    base = [engine.tokenizer.encode(render_prompt(q.question), add_special_tokens=False) for q in questions]
    prompts = [base[i % len(base)] for i in range(batch)]
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, seed=99)
    eng, bare = [], []
    for _ in range(repeats):
        engine.prefix_cache.clear()  # both sides prefill every prompt
        t0 = time.perf_counter()
        out = engine.generate(prompts, spec)
        eng.append(sum(len(s[0].token_ids) for s in out) / (time.perf_counter() - t0))
        bare.append(bare_decode_tokens_per_s(engine.base, prompts, new_tokens, engine.pad_id))
    e, b = statistics.median(eng), statistics.median(bare)
    return {"batch": len(prompts), "new_tokens": new_tokens, "engine_tokens_per_s": e,
            "bare_forward_tokens_per_s": b, "ratio": e / b}


def bench_adapter_decode(model: str, questions, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decoding with an RL-shaped adapter (LoRA r16, alpha 32, every linear projection, random B) as PEFT's LoRA
    layers on the base against a merged copy (the policy's default, merge_adapters) and the bare base, on the same
    first-step prompts; medians of interleaved runs."""
    from services.policy.engine import TransformersEngine

    peft_model, tok = random_lora(model)
    adapter_dir = tempfile.mkdtemp(prefix="bench-adapter-")
    peft_model.save_pretrained(adapter_dir)
    engines = {"peft_layers": TransformersEngine(model, max_batch_size=512, merge_adapters=False),
               "merged": TransformersEngine(model, max_batch_size=512, merge_adapters=True),
               "base": TransformersEngine(model, max_batch_size=512)}
    for name in ("peft_layers", "merged"):
        engines[name].load_adapter("bench", adapter_dir)
    firsts = [tok.encode(render_prompt(q.question), add_special_tokens=False) for q in questions]
    prompts = [firsts[i % len(firsts)] for i in range(batch)]
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, seed=99)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.prefix_cache.clear()
            t0 = time.perf_counter()
            out = engine.generate(prompts, spec, adapter=None if name == "base" else "bench")
            rates[name].append(sum(len(s[0].token_ids) for s in out) / (time.perf_counter() - t0))
    med = {f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()}
    return {"batch": batch, "new_tokens": new_tokens, **med,
            "merged_vs_peft_layers": med["merged_tokens_per_s"] / med["peft_layers_tokens_per_s"],
            "merged_vs_base": med["merged_tokens_per_s"] / med["base_tokens_per_s"]}
