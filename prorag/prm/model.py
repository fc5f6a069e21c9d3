"""The process reward model: the SFT policy's trunk with a scalar head on every position.

A token-classification head (one label) rather than sequence classification: the model is causal, so the
scalar at a step's last token depends only on the tokens up to it, and one forward pass over a whole
trajectory scores every step exactly as scoring each prefix on its own would (tests/prm/test_model.py checks
it). Sequence classification pools one position per row and would need one row per step (the reference
code's cost). Where steps are scored: prorag.algorithms.prm.score_positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from prorag.algorithms.prm import branch_attention, left_truncate
from prorag.errors import InvalidArgument, NotFound
from prorag.modeling import _dtype, _quiet, add_format_tokens


def _tokenizer(path: str | Path, what: str):
    """The directory's tokenizer with a pad token (eos when it has none); NotFound for a missing directory."""
    from transformers import AutoTokenizer

    _quiet()
    if not Path(path).is_dir():
        raise NotFound(f"{what} directory {path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prm_from_policy(policy_dir: str | Path, seed: int = 0, dtype="float32", attn_implementation: str | None = None):
    """A new PRM from a policy directory: its trunk and tokenizer, a scalar head initialised from ``seed``
    (N(0, 0.02), as the trunk's linear layers). Returns (model, tokenizer), the model in train mode on the CPU
    (a stage places it: prorag.modeling.prepare_for_training)."""
    from transformers import AutoModelForTokenClassification

    tokenizer = _tokenizer(policy_dir, "policy")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForTokenClassification.from_pretrained(str(policy_dir), num_labels=1, dtype=_dtype(dtype),
                                                            **extra)
    add_format_tokens(tokenizer, model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * 0.02)
        if model.score.bias is not None:
            model.score.bias.zero_()
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.train(), tokenizer


def load_prm(path: str | Path, device: str | torch.device = "cpu", dtype="float32",
             attn_implementation: str | None = None):
    """A saved PRM directory (prorag.modeling.save_pretrained of a prm_from_policy model); (model eval, tok)."""
    from transformers import AutoModelForTokenClassification

    tokenizer = _tokenizer(path, "PRM")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForTokenClassification.from_pretrained(str(path), dtype=_dtype(dtype), **extra)
    if model.config.num_labels != 1:
        raise InvalidArgument(f"{path} is not a PRM: its head has {model.config.num_labels} outputs, not 1")
    return model.to(device).eval(), tokenizer


def score_batch(model, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], max_len: int,
                pad_id: int = 0, keep_prefix: int = 0) -> list[list[float | None]]:
    """Score every listed position of every sequence in one forward pass.

    sequences: B token-id lists; positions: per sequence, the indices whose scalar is a step's score; longer
    sequences than max_len are cut on the left after keep_prefix tokens (prorag.algorithms.prm.left_truncate:
    the newest step always stays). Returns [B][S_b] scores as 0-d tensors (``float(s)`` for a number), None for a step whose score token
    was cut away.
    Gradients flow when the model is in train mode and grad is enabled (training uses this too)."""
    if len(sequences) != len(positions):
        raise InvalidArgument("one positions list per sequence")
    cut = [left_truncate(ids, pos, max_len, keep_prefix) for ids, pos in zip(sequences, positions)]
    T = max(len(ids) for ids, _ in cut)
    x = torch.full((len(cut), T), pad_id, dtype=torch.long)
    for i, (ids, _) in enumerate(cut):
        x[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    device = next(model.parameters()).device
    # No attention mask: the padding is on the right of a causal model, so no real position attends to it and
    # every score is the one its row gets alone (tests/prm/test_model.py); a padding mask would only send SDPA from
    # its fused causal kernel to the math one, which materialises B x heads x T x T scores (measured on CPU: a batch
    # of 32 trajectories ran at a third of the speed of one at a time; issue 49). Positions count from 0 in every row.
    # use_cache=False: scoring and training read every position once; a KV cache would only cost memory
    logits = model(input_ids=x.to(device), use_cache=False).logits[..., 0].float()
    return [[None if p is None else logits[i, p] for p in pos] for i, (_, pos) in enumerate(cut)]


#: attention implementations that take a custom 4D mask (flash_attention_2 takes none: only padding and packing)
BRANCH_ATTENTION = ("sdpa", "eager")


def attn_implementation(model) -> str | None:
    """The attention implementation ``model`` (or the module a wrapper holds) runs with."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "_attn_implementation", None)


def score_branched(model, sequences: Sequence[Sequence[int]], branches: Sequence[tuple[int, int, int]],
                   positions: Sequence[Sequence[int]], pad_id: int = 0) -> list[list[torch.Tensor]]:
    """Score the listed positions of sequences that each hold a prefix and two branches continuing it, in one
    forward pass with a custom attention mask (prorag.algorithms.prm.branch_attention).

    sequences: B token-id lists, each its prefix, first branch and second branch; branches [B]: their (prefix,
    first, second) token counts (first = second = 0 for a plain sequence); positions: per sequence, indices into
    it. A second-branch token scores as it would right after the prefix in a sequence of its own, up to float
    rounding (tests/prm/test_model.py). No truncation: the caller fits each branch into its max_len. The model
    must run sdpa or eager attention (BRANCH_ATTENTION). Returns [B][S_b] scores as 0-d tensors; gradients flow
    as in score_batch."""

    if not len(sequences) == len(branches) == len(positions):
        raise InvalidArgument("one branches triple and one positions list per sequence")
    impl = attn_implementation(model)
    if impl not in BRANCH_ATTENTION:
        raise InvalidArgument(f"branched scoring needs a custom attention mask: attn_implementation {impl!r} takes "
                              f"none (use one of {', '.join(BRANCH_ATTENTION)})")
    if any(sum(b) != len(ids) for ids, b in zip(sequences, branches)):
        raise InvalidArgument("a sequence's branches must add up to its length")
    T = max(len(ids) for ids in sequences)
    x = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    for i, ids in enumerate(sequences):
        x[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    allowed, position_ids = branch_attention(branches, T)
    param = next(model.parameters())
    mask = allowed.unsqueeze(1).to(param.device)  # [B, 1, T, T]: one mask for every head
    if impl == "eager":  # eager adds the mask to the scores: 0 where allowed, the dtype's lowest elsewhere
        mask = torch.zeros(mask.shape, dtype=param.dtype, device=param.device).masked_fill_(
            ~mask, torch.finfo(param.dtype).min)
    # A 4D mask reaches the attention as given (transformers' create_causal_mask returns it unchanged); with a 2D
    # mask or none, a position_ids restart would instead be read as sequence packing.
    logits = model(input_ids=x.to(param.device), attention_mask=mask, position_ids=position_ids.to(param.device),
                   use_cache=False).logits[..., 0].float()
    return [[logits[i, p] for p in pos] for i, pos in enumerate(positions)]


__all__ = ["BRANCH_ATTENTION", "attn_implementation", "load_prm", "prm_from_policy", "score_batch", "score_branched"]
