"""PRM engine: every step of many trajectories scored in one forward pass per batch of rows.

A trajectory is rendered once (prorag.search.pairs.prm_rendering) and read at each step's last token (plus, for a PRM
with a likelihood weight, its trunk's likelihood of the step's written tokens). One that does not
fit the context is cut on the left (prompt kept); steps whose score token the cut removed are scored on rows
of their own (their prefix, cut the same way), in the same forward pass. The reference code instead cut on
the right, dropping the newest step, and called the model once per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from prorag.algorithms.prm import left_truncate_steps
from prorag.search.pairs import prm_rendering, prompt_length
from prorag.prm.model import load_prm, score_batch
from prorag.registry import artifact_name
from prorag.trajectory import Step
from prorag.training.devices import CPU_FP32, Placement, is_out_of_memory, out_of_memory


#: a CPU's bound on padded tokens per real token in one forward pass: rows of equal length only. Measured in
#: process on the bench's trajectories, 1 thread: 32 per call scored 191 steps per CPU-second at 1.0, 174 at 1.03,
#: 148 at 1.1, 81 unbounded, against 184 one at a time (docs/BENCHMARKS.md, "Thirty-eighth session"). A GPU, where a
#: pass's fixed cost dominates, keeps the token bound alone (not measured there).
CPU_BATCH_PADDING = 1.0


def length_batches(lengths: Sequence[int], max_tokens: int, max_padding: float) -> list[list[int]]:
    """Rows of ``lengths`` (tokens, ascending) cut into forward passes [[row index, ...], ...] in order: a pass ends
    before the row that would make it hold more than ``max_tokens`` tokens padded (rows x longest), or make those
    padded tokens more than ``max_padding`` times its real ones. A row is never split; one longer than
    ``max_tokens`` runs alone.

    Why the padding bound: a pass computes every padded position, attention quadratically in the longest row, so
    the bench's trajectories (176 to 656 tokens) cost 1.6-1.8x their real tokens batched 8-64 at a time and scored
    fewer steps per CPU-second than one at a time (docs/BENCHMARKS.md, "Thirty-eighth session").

    >>> length_batches([100, 100, 110, 300, 310], max_tokens=10_000, max_padding=1.25)
    [[0, 1, 2], [3, 4]]
    >>> length_batches([100, 100, 100], max_tokens=250, max_padding=2.0)
    [[0, 1], [2]]
    """
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError("lengths must be ascending")
    if max_padding < 1.0:
        raise ValueError(f"max_padding {max_padding:g}: padded tokens are at least the real ones")
    out: list[list[int]] = []
    chunk: list[int] = []
    real = 0
    for i, n in enumerate(lengths):
        padded = (len(chunk) + 1) * n  # the new row is the longest: every row pads to it
        if chunk and (padded > max_tokens or padded > max_padding * (real + n)):
            out.append(chunk)
            chunk, real = [], 0
        chunk.append(i)
        real += n
    if chunk:
        out.append(chunk)
    return out


@dataclass
class ScoringItem:
    question: str
    steps: list[Step]
    last_step_only: bool = False


class PRMEngine:
    """Loads a PRM directory; ``score(items)`` -> per item, one float per scored step."""

    def __init__(self, model_dir: str | Path, max_len: int = 0, max_batch_tokens: int = 32768,
                 placement: Placement = CPU_FP32, max_batch_padding: float = 0.0):
        """placement: device, weights dtype and attention kernel (prorag.training.devices.resolve of the service's
        config); every later load (a hot-swap) uses the same. max_batch_tokens / max_batch_padding: the bounds of
        one forward pass (:func:`length_batches`); padding 0 = :data:`CPU_BATCH_PADDING` on a CPU, none on a GPU."""
        self.lock = threading.Lock()
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_padding = max_batch_padding or (
            CPU_BATCH_PADDING if torch.device(placement.device).type == "cpu" else float("inf"))
        self._max_len_cfg = max_len
        self.placement = placement
        self.load(model_dir)

    def load(self, model_dir: str | Path) -> str:
        """(Re)load weights; returns the new version. Calls in flight finish on the old model."""
        pl = self.placement
        model, tok = load_prm(model_dir, device=pl.device, dtype=pl.dtype,
                              attn_implementation=pl.attn_implementation)
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        with self.lock:
            self.model, self.tokenizer, self.model_dir = model, tok, Path(model_dir)
            self.max_len = min(self._max_len_cfg or limit, limit)
            self.version = artifact_name(model_dir)
        return self.version

    def _rows(self, item: ScoringItem) -> tuple[list[tuple[list[int], list[int | None], list[list[int]]]],
                                                list[tuple[int, int]]]:
        """Rows to run, each (ids, score positions, per position its step's written-token indices), and, per scored
        step, (row, index into that row's positions)."""
        ids, positions, written = prm_rendering(self.tokenizer, item.question, item.steps)
        keep = prompt_length(self.tokenizer, item.question)
        wanted = [len(positions) - 1] if item.last_step_only else list(range(len(positions)))
        rows = [left_truncate_steps(ids, [positions[k] for k in wanted], [written[k] for k in wanted],
                                    self.max_len, keep)]
        where = []
        for j, k in enumerate(wanted):
            if rows[0][1][j] is not None:
                where.append((0, j))
            else:  # its score token was cut away: score its own prefix
                p = positions[k]
                rows.append(left_truncate_steps(ids[:p + 1], [p], [written[k]], self.max_len, keep))
                where.append((len(rows) - 1, 0))
        return rows, where

    def score(self, items: Sequence[ScoringItem]) -> list[tuple[str, list[float]]]:
        """Per item: (the model version that scored it, one score per scored step). Safe to call from several
        threads at once (the service's engine workers): the model is read-only here, and rendering, which uses the
        tokenizer, is done under the lock a hot swap takes, so one call renders and scores with one model."""
        with self.lock:
            model, tok, version, max_len = self.model, self.tokenizer, self.version, self.max_len
            plans = [self._rows(it) for it in items]
        flat = [(i, r) for i, (rows, _) in enumerate(plans) for r in range(len(rows))]
        results: dict[tuple[int, int], list] = {}

        def run(chunk):
            seqs = [plans[i][0][r][0] for i, r in chunk]
            kept = [[n for n, p in enumerate(plans[i][0][r][1]) if p is not None] for i, r in chunk]
            pos = [[plans[i][0][r][1][n] for n in ns] for (i, r), ns in zip(chunk, kept)]
            written = [[plans[i][0][r][2][n] for n in ns] for (i, r), ns in zip(chunk, kept)]
            try:
                with torch.no_grad():
                    out = score_batch(model, seqs, pos, max_len=max_len, pad_id=tok.pad_token_id or 0,
                                      written=written)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                # this request fails with the size that did not fit; the service goes on serving
                raise out_of_memory(exc, f"scoring {len(chunk)} rows of up to {max(map(len, seqs))} tokens",
                                    "send fewer trajectories per request or lower the service's "
                                    "max_batch_tokens") from None
            for (i, r), scores in zip(chunk, out):
                results[(i, r)] = [float(s) for s in scores]

        # Rows by length, so each forward pass pads to a near neighbour rather than to the longest of a random
        # mix, in passes whose padded tokens stay within both bounds.
        flat.sort(key=lambda key: len(plans[key[0]][0][key[1]][0]))
        lengths = [len(plans[i][0][r][0]) for i, r in flat]
        for part in length_batches(lengths, self.max_batch_tokens, self.max_batch_padding):
            run([flat[k] for k in part])
        out = []
        for i, (rows, where) in enumerate(plans):
            # index among the row's kept (non-None) positions
            kept_index = {r: {j: n for n, j in enumerate(jj for jj, p in enumerate(rows[r][1]) if p is not None)}
                          for r in range(len(rows))}
            out.append((version, [results[(i, r)][kept_index[r][j]] for r, j in where]))
        return out

