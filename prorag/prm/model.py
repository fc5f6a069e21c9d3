"""The process reward model: the SFT policy's trunk with a scalar head on every position.

A token-classification head (one label) rather than sequence classification: the model is causal, so the
scalar at a step's last token depends only on the tokens up to it, and one forward pass over a whole
trajectory scores every step exactly as scoring each prefix on its own would (tests/prm/test_model.py checks
it). Sequence classification pools one position per row and would need one row per step (the reference
code's cost). Where steps are scored: prorag.algorithms.prm.score_positions.

Optionally (``prm_likelihood_weight`` in the PRM's config, set when it is made) a step's score also adds that weight
times the trunk's own mean log-probability of the tokens the step's writer wrote, read through the input embeddings
the trunk's LM head was tied to: the SFT trunk already tells sound steps from corrupted ones by that likelihood
(docs/BENCHMARKS.md, thirty-fifth session), and the pair loss then trains head and readout together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from prorag.algorithms.prm import branch_attention, left_truncate, left_truncate_steps, mean_per_step, predecessors
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound
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


#: the PRM config attribute (saved in its config.json) holding the likelihood readout's weight; absent = 0 (head only)
LIKELIHOOD_WEIGHT = "prm_likelihood_weight"

#: written tokens whose vocabulary log-probabilities one matrix product computes: bounds the [K, vocab] block (a
#: 152k-token vocabulary at 4,096 positions is 2.5 GB in float32)
LOGPROB_CHUNK = 4096


def _config(model):
    return getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)


def likelihood_weight(model) -> float:
    """The weight of the trunk's written-token likelihood in ``model``'s step score (0: its head alone)."""
    return float(getattr(_config(model), LIKELIHOOD_WEIGHT, 0.0) or 0.0)


def _require_tied(config, what: str) -> None:
    # Why tied only: a token-classification model holds no LM head of its own; a tied one is the input embeddings
    if not getattr(config, "tie_word_embeddings", False):
        raise FailedPrecondition(f"{what}'s LM head is not tied to its input embeddings (tie_word_embeddings false, "
                                 "as in Qwen3-8B), so the PRM cannot read its trunk's likelihood: use "
                                 "likelihood_weight 0, or a policy with tied embeddings (Qwen3-0.6B to 4B, the "
                                 "embedded models)")


def prm_from_policy(policy_dir: str | Path, seed: int = 0, dtype="float32", attn_implementation: str | None = None,
                    likelihood_weight: float = 0.0):
    """A new PRM from a policy directory: its trunk and tokenizer, a scalar head initialised from ``seed``
    (N(0, 0.02), as the trunk's linear layers). likelihood_weight > 0: its scores also add that weight times the
    trunk's mean log-probability of each step's written tokens (saved in its config; needs tied embeddings).
    Returns (model, tokenizer), the model in train mode on the CPU (a stage places it:
    prorag.modeling.prepare_for_training)."""
    from transformers import AutoModelForTokenClassification

    if likelihood_weight < 0:
        raise InvalidArgument(f"likelihood_weight must be >= 0, got {likelihood_weight}")
    tokenizer = _tokenizer(policy_dir, "policy")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForTokenClassification.from_pretrained(str(policy_dir), num_labels=1, dtype=_dtype(dtype),
                                                            **extra)
    if likelihood_weight:
        _require_tied(model.config, f"policy {policy_dir}")
        _final_norm(model)
    setattr(model.config, LIKELIHOOD_WEIGHT, float(likelihood_weight))
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
    if likelihood_weight(model):
        _require_tied(model.config, f"PRM {path}")
    return model.to(device).eval(), tokenizer


def _final_norm(model):
    """The trunk's last module, whose output is its normed last hidden state: what a tied LM head reads."""
    inner = getattr(model, "module", model)
    norm = getattr(getattr(inner, "base_model", inner), "norm", None)
    if norm is None:
        raise FailedPrecondition(f"{type(inner).__name__} has no final norm (base_model.norm) to read the trunk's "
                                 "hidden state from: the likelihood readout needs a Qwen3- or Llama-style trunk")
    return norm


def _forward(model, reads_likelihood: bool, **inputs):
    """(the model's output, the trunk's normed last hidden state [B, T, H] or None): when the likelihood is read,
    the hidden state is caught by a hook on the final norm. Why not output_hidden_states: that keeps every layer's
    output alive, which under no_grad (the PRM service) would hold L times the activations for one of them."""
    if not reads_likelihood:
        return model(**inputs, use_cache=False), None
    caught = []
    handle = _final_norm(model).register_forward_hook(lambda module, args, output: caught.append(output))
    try:
        out = model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return out, caught[-1]


def _step_scores(model, out, hidden, x: torch.Tensor, positions, written, branches,
                 likelihood_only: bool = False) -> list[list[torch.Tensor | None]]:
    """Each listed position's score from one forward pass's output: the head's scalar there, plus, for a PRM with a
    likelihood weight, that weight times the mean log-probability of the step's written tokens (written [B][S_b]
    index lists; each token predicted by prorag.algorithms.prm.predecessors of its row's branches).
    likelihood_only: that mean log-probability alone (weight 1, no head), whatever the PRM's weight."""
    head = out.logits[..., 0].float()
    weight = 1.0 if likelihood_only else likelihood_weight(model)
    if not weight:
        return [[None if p is None else head[i, p] for p in pos] for i, pos in enumerate(positions)]
    if written is None:
        raise InvalidArgument(f"this PRM adds its trunk's likelihood of each step's written tokens ({LIKELIHOOD_WEIGHT}"
                              f" {weight}): pass each step's written-token indices (prorag.search.pairs.prm_rendering)")
    rows, preds, targets, step_of, slots = [], [], [], [], []
    for i, (pos, wr) in enumerate(zip(positions, written)):
        for k, (p, w) in enumerate(zip(pos, wr)):
            if p is None:
                continue
            for j, q in zip(w, predecessors(w, branches[i])):
                rows.append(i)
                preds.append(q)
                targets.append(j)
                step_of.append(len(slots))
            slots.append((i, k))
    # [H, V], cast once for every chunk: the tied LM head the trunk's last hidden state is read with
    lm_head = getattr(model, "module", model).get_input_embeddings().weight.float().T
    rows_t, targets_t = torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    preds_t = torch.tensor(preds, dtype=torch.long)
    token_logp = []
    for a in range(0, len(rows), LOGPROB_CHUNK):
        part = slice(a, a + LOGPROB_CHUNK)
        h = hidden[rows_t[part].to(hidden.device), preds_t[part].to(hidden.device)].float()  # [K, H]
        logp = torch.log_softmax(h @ lm_head, dim=-1)  # [K, V]
        token_logp.append(logp.gather(1, x[rows_t[part], targets_t[part]].to(logp.device)[:, None])[:, 0])
    means = mean_per_step(torch.cat(token_logp) if token_logp else head.new_zeros(0),
                          torch.tensor(step_of, dtype=torch.long, device=head.device), len(slots))
    scores: list[list[torch.Tensor | None]] = [[None] * len(pos) for pos in positions]
    for n, (i, k) in enumerate(slots):
        scores[i][k] = weight * means[n] if likelihood_only else head[i, positions[i][k]] + weight * means[n]
    return scores


def score_batch(model, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], max_len: int,
                pad_id: int = 0, keep_prefix: int = 0, written: Sequence[Sequence[Sequence[int]]] | None = None,
                likelihood_only: bool = False) -> list[list[float | None]]:
    """Score every listed position of every sequence in one forward pass.

    sequences: B token-id lists; positions: per sequence, the indices whose scalar is a step's score; longer
    sequences than max_len are cut on the left after keep_prefix tokens (prorag.algorithms.prm.left_truncate:
    the newest step always stays); written: per sequence, per position, the indices of the step's written tokens
    (prorag.search.pairs.prm_rendering), needed by a PRM with a likelihood weight. Returns [B][S_b] scores as 0-d
    tensors (``float(s)`` for a number), None for a step whose score token was cut away. likelihood_only: each
    step's mean written-token log-probability under the trunk read as its tied LM, without the head (the policy's
    own preference, for a PRM still at its start: the reference a trained PRM is read against).
    Gradients flow when the model is in train mode and grad is enabled (training uses this too)."""
    if len(sequences) != len(positions):
        raise InvalidArgument("one positions list per sequence")
    if written is None:
        cut = [(*left_truncate(ids, pos, max_len, keep_prefix), None) for ids, pos in zip(sequences, positions)]
    else:
        cut = [left_truncate_steps(ids, pos, w, max_len, keep_prefix)
               for ids, pos, w in zip(sequences, positions, written)]
    T = max(len(ids) for ids, _, _ in cut)
    x = torch.full((len(cut), T), pad_id, dtype=torch.long)
    for i, (ids, _, _) in enumerate(cut):
        x[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    device = next(model.parameters()).device
    # No attention mask: the padding is on the right of a causal model, so no real position attends to it and
    # every score is the one its row gets alone (tests/prm/test_model.py); a padding mask would only send SDPA from
    # its fused causal kernel to the math one, which materialises B x heads x T x T scores (measured on CPU: a batch
    # of 32 trajectories ran at a third of the speed of one at a time; issue 49). Positions count from 0 in every row.
    # use_cache=False: scoring and training read every position once; a KV cache would only cost memory
    if likelihood_only:
        _require_tied(_config(model), "this model")
    out, hidden = _forward(model, likelihood_only or bool(likelihood_weight(model)), input_ids=x.to(device))
    return _step_scores(model, out, hidden, x, [pos for _, pos, _ in cut],
                        None if written is None else [w for *_, w in cut], [(len(ids), 0, 0) for ids, _, _ in cut],
                        likelihood_only=likelihood_only)


#: attention implementations that take a custom 4D mask (flash_attention_2 takes none: only padding and packing)
BRANCH_ATTENTION = ("sdpa", "eager")


def attn_implementation(model) -> str | None:
    """The attention implementation ``model`` (or the module a wrapper holds) runs with."""
    return getattr(_config(model), "_attn_implementation", None)


def score_branched(model, sequences: Sequence[Sequence[int]], branches: Sequence[tuple[int, int, int]],
                   positions: Sequence[Sequence[int]], pad_id: int = 0,
                   written: Sequence[Sequence[Sequence[int]]] | None = None) -> list[list[torch.Tensor]]:
    """Score the listed positions of sequences that each hold a prefix and two branches continuing it, in one
    forward pass with a custom attention mask (prorag.algorithms.prm.branch_attention).

    sequences: B token-id lists, each its prefix, first branch and second branch; branches [B]: their (prefix,
    first, second) token counts (first = second = 0 for a plain sequence); positions: per sequence, indices into
    it; written: per position, its step's written-token indices into the row (as score_batch's). A second-branch
    token scores as it would right after the prefix in a sequence of its own, up to float rounding
    (tests/prm/test_model.py). No truncation: the caller fits each branch into its max_len. The model
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
    out, hidden = _forward(model, bool(likelihood_weight(model)), input_ids=x.to(param.device), attention_mask=mask,
                           position_ids=position_ids.to(param.device))
    return _step_scores(model, out, hidden, x, positions, written, branches)


__all__ = ["BRANCH_ATTENTION", "LIKELIHOOD_WEIGHT", "attn_implementation", "likelihood_weight", "load_prm",
           "prm_from_policy", "score_batch", "score_branched"]
