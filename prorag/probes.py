"""Probes that make an agent's failure visible before its F1 does: can the model copy a name it has read?

The agent's subqueries must copy the question's entity, its subanswers a name from a document; a small model
that cannot copy (no induction circuit) writes fragments instead ("When wasWhoWhoWhen was..."). The probe
shows names in a context and asks for them again, greedy and teacher-forced, in one forward pass per batch.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch


def copy_rows(tokenizer, names: Sequence[str], per_row: int = 4, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Rows "A, B, C, D. A, B, C, D." of names drawn from ``names``: (token ids [T], scored [T]) where
    scored[t] = 1 marks the tokens of the repeated names after their first: given a name's first token, the
    rest can only come from reading it earlier (induction). The first token is not scored: which name comes
    next is not a copying question. Names of one token have nothing scored and do not count."""
    rng = random.Random(seed)
    pool = list(dict.fromkeys(n for n in names if n.strip()))
    rows = []
    for i in range(0, len(pool) - per_row + 1, per_row):
        group = pool[i:i + per_row]
        rng.shuffle(group)
        ids, scored = [], []
        for repeat in (0, 1):
            for j, name in enumerate(group):
                sep = ", " if j < len(group) - 1 else ". "
                # each name encoded on its own, so both occurrences are the very same ids
                name_ids = tokenizer.encode(name, add_special_tokens=False)
                sep_ids = tokenizer.encode(sep, add_special_tokens=False)
                ids += name_ids + sep_ids
                scored += [0] + [repeat] * (len(name_ids) - 1) + [0] * len(sep_ids)
        rows.append((ids, scored))
    return rows


@torch.no_grad()
def name_copy_accuracy(model, tokenizer, names: Sequence[str], per_row: int = 4, max_rows: int = 64,
                       seed: int = 0) -> dict:
    """Greedy teacher-forced copying of names seen earlier in the context.

    Returns {"token_accuracy": share of the repeated names' scored tokens predicted exactly, "name_accuracy":
    share of repeated names with every scored token right, "names": how many names were scored}. A model that
    copies scores near 1, one that cannot near 0."""
    rows = copy_rows(tokenizer, names, per_row, seed)[:max_rows]
    if not rows:
        raise ValueError(f"the copy probe needs at least {per_row} distinct names")
    was_training = model.training
    model.eval()
    hits = total = names_right = names_scored = 0
    try:
        pad = tokenizer.pad_token_id or 0
        T = max(len(ids) for ids, _ in rows)
        x = torch.full((len(rows), T), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), T), dtype=torch.long)
        for i, (ids, _) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
            attn[i, :len(ids)] = 1
        pred = model(input_ids=x, attention_mask=attn).logits.argmax(-1)  # [B, T]: prediction of token t+1
        for i, (ids, scored) in enumerate(rows):
            run_ok, in_name = True, False
            for t in range(1, len(ids)):
                if scored[t]:
                    ok = int(pred[i, t - 1]) == ids[t]
                    hits += ok
                    total += 1
                    run_ok = run_ok and ok
                    in_name = True
                elif in_name:  # a repeated name just ended
                    names_right += run_ok
                    names_scored += 1
                    run_ok, in_name = True, False
            if in_name:
                names_right += run_ok
                names_scored += 1
    finally:
        model.train(was_training)
    return {"token_accuracy": hits / max(total, 1), "name_accuracy": names_right / max(names_scored, 1),
            "names": names_scored}


__all__ = ["copy_rows", "name_copy_accuracy"]
