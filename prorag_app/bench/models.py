"""The models the benchmarks measure: a published one when there is one, else one made the same shape (the
benchmarks measure speed, not judgement)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prorag.errors import NotFound
from prorag.registry import registry
from prorag_app.embedded import ensure_policy_model


def bench_model(world: str, model: str) -> str:
    """The model to benchmark: a path, a published name (sft -> newest sft), or the embedded base."""
    if model == "base":
        return str(ensure_policy_model(world))
    try:
        return str(registry("model", world).resolve(model))
    except NotFound:
        if model != "sft":
            raise
        return str(ensure_policy_model(world))  # nothing trained yet: the base model


def bench_prm_model(world: str, model: str) -> str:
    """A published PRM (name[@version] or path); with none published, a PRM freshly made from the world's
    policy (same shape and cost: the benchmark measures speed, not judgement)."""
    from prorag.modeling import save_pretrained  # torch: only when a model is built here
    from prorag.prm.model import prm_from_policy
    try:
        return str(registry("prm", world).resolve(model))
    except NotFound:
        if model != "prm":
            raise
    out = Path(tempfile.mkdtemp(prefix="bench-prm-")) / "prm"
    prm, tok = prm_from_policy(bench_model(world, "sft"), seed=0)
    save_pretrained(prm, tok, out)
    return str(out)


def random_lora(model: str):
    """(``model`` with an RL-shaped LoRA: r16, alpha 32, every linear projection, B drawn so it changes the
    outputs, its tokenizer)."""
    import torch  # torch, peft: only when an adapter is built here
    from peft import LoraConfig, get_peft_model

    from prorag.modeling import load_policy

    m, tok = load_policy(model)
    peft_model = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return peft_model, tok
