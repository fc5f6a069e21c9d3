"""The one answer normaliser and QA metrics used by every stage.

Rewards, RFT filtering, MCTS values and evaluation all score answers through
this module, so a number means the same thing everywhere (ProRAG mixes raw
``lower().split()`` with exact match; we don't).

Normalisation is the SQuAD v1.1 one: lowercase, drop ASCII punctuation
(``string.punctuation``), drop the articles a/an/the as whole words, collapse
whitespace. Accents and non-ASCII punctuation are kept, as in the official
script. F1 follows HotpotQA's official rule for yes/no/noanswer.

One deliberate difference from the official scripts: a prediction that is
empty after normalisation scores 0 on every metric (the official EM would give
1 against a gold that also normalises to empty, e.g. "The"), so an empty or
article-only answer can never earn reward. Likewise a gold alias that is empty
after normalisation matches nothing (FlashRAG's ``acc`` would find "" inside any
prediction).

Two containment metrics: ``cover_em`` (ours) asks for a gold as a contiguous
run of whole tokens, so "1931" does not cover "19"; ``acc`` is FlashRAG's
``acc`` and Search-R1's ``subem`` (the normalised gold as a raw substring of the
normalised prediction), reported under that name so figures compare with
published ones.

>>> normalize_answer("The  Beatles!")
'beatles'
>>> exact_match("the beatles", ["Beatles", "John Lennon"])
1.0
>>> f1_score("yes", "no")
0.0
"""

from __future__ import annotations

import collections
import re
import string
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "normalize_answer",
    "exact_match",
    "f1_score",
    "cover_exact_match",
    "substring_match",
    "qa_scores",
    "bootstrap_ci",
    "seed_question_bootstrap_ci",
    "summarize",
]

_PUNCT = frozenset(string.punctuation)
# \b uses Unicode word characters, exactly like the official regex, so "the"
# between em-dashes (not ASCII punctuation, hence not removed) is still dropped.
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL = frozenset({"yes", "no", "noanswer"})


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation, same step order: lower -> punctuation -> articles -> whitespace."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


def _em_one(pred_n: str, gold_n: str) -> float:
    return float(pred_n == gold_n)


def _f1_one(pred_n: str, gold_n: str) -> float:
    # HotpotQA: a yes/no/noanswer on either side only scores when both sides agree exactly
    if (pred_n in _SPECIAL or gold_n in _SPECIAL) and pred_n != gold_n:
        return 0.0
    p_toks, g_toks = pred_n.split(), gold_n.split()
    same = sum((collections.Counter(p_toks) & collections.Counter(g_toks)).values())
    if same == 0:
        return 0.0
    precision = same / len(p_toks)
    recall = same / len(g_toks)
    return 2 * precision * recall / (precision + recall)


def _cover_one(pred_n: str, gold_n: str) -> float:
    # token-span containment, so "1931" does not cover "19" and "art" is not inside "party"
    p, g = pred_n.split(), gold_n.split()
    if not g or len(g) > len(p):
        return 0.0
    k = len(g)
    return float(any(p[i:i + k] == g for i in range(len(p) - k + 1)))


def _substring_one(pred_n: str, gold_n: str) -> float:
    return float(bool(gold_n) and gold_n in pred_n)


def _best(fn, pred: str, golds: str | Iterable[str]) -> float:
    pred_n = normalize_answer(pred if pred is not None else "")
    if not pred_n:
        return 0.0
    return max((fn(pred_n, normalize_answer(g)) for g in _golds(golds)), default=0.0)


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold alias.

    Deviates from the official SQuAD/FlashRAG EM only where both sides normalise to empty (0 here, 1 there)."""
    return _best(_em_one, pred, golds)


def f1_score(pred: str, golds: str | Iterable[str]) -> float:
    """Token F1 (HotpotQA official rule), max over gold aliases."""
    return _best(_f1_one, pred, golds)


def cover_exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if some normalised gold alias occurs as a contiguous token span of the normalised prediction."""
    return _best(_cover_one, pred, golds)


def substring_match(pred: str, golds: str | Iterable[str]) -> float:
    """FlashRAG's ``acc`` (Search-R1's ``subem``): 1.0 if some normalised gold alias is a substring of the
    normalised prediction, characters not tokens ("19" is inside "1931" here, not for ``cover_em``).

    >>> substring_match("born in 1931", ["19"]), cover_exact_match("born in 1931", ["19"])
    (1.0, 0.0)
    """
    return _best(_substring_one, pred, golds)


def qa_scores(pred: str, golds: str | Iterable[str]) -> dict[str, float]:
    """Every answer metric at once: ``{"em", "f1", "cover_em", "acc"}`` (acc = FlashRAG acc / Search-R1 subem)."""
    return {
        "em": exact_match(pred, golds),
        "f1": f1_score(pred, golds),
        "cover_em": cover_exact_match(pred, golds),
        "acc": substring_match(pred, golds),
    }


def seed_question_bootstrap_ci(diffs, n_resamples: int = 2000, alpha: float = 0.05,
                               seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``diffs`` [n_seeds][n_questions] resampling seeds, then questions.

    Each resample draws n_seeds seeds and n_questions questions with replacement and takes the mean over that
    seeds x questions grid, so the interval carries training noise (which seed's run) as well as which questions
    were asked; averaging the seeds first and resampling questions alone (``bootstrap_ci`` of the seed means)
    leaves the seed variance out. A question keeps its pairing across seeds (the same question ids in every row).
    One seed: the question bootstrap alone.
    """
    x = np.asarray(diffs, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"diffs must be a non-empty [n_seeds][n_questions] array, got shape {x.shape}")
    n_seeds, n_q = x.shape
    if n_seeds == 1:
        return bootstrap_ci(x[0], n_resamples=n_resamples, alpha=alpha, seed=seed)
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples, dtype=np.float64)
    rows = max(1, min(n_resamples, 4_000_000 // (n_seeds * n_q)))  # resamples per chunk: bounded memory
    for start in range(0, n_resamples, rows):
        stop = min(n_resamples, start + rows)
        s_idx = rng.integers(0, n_seeds, size=(stop - start, n_seeds))
        q_idx = rng.integers(0, n_q, size=(stop - start, n_q))
        means[start:stop] = x[s_idx[:, :, None], q_idx[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return (float(lo), float(hi))


def bootstrap_ci(values: Sequence[float], n_resamples: int = 1000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values``.

    Resampling is vectorised in row chunks so memory stays bounded for large n.
    Returns ``(nan, nan)`` for no values and ``(v, v)`` for one.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n == 0:
        return (float("nan"), float("nan"))
    if n == 1:
        return (float(x[0]), float(x[0]))
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    rows = max(1, min(n_resamples, 4_000_000 // n))
    means = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, rows):
        stop = min(n_resamples, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = x[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return (float(lo), float(hi))


def summarize(values: Sequence[float], n_resamples: int = 1000, alpha: float = 0.05,
              seed: int = 0) -> dict:
    """``{"n", "mean", "ci": [lo, hi]}``; mean and ci are None when there are no values (JSON-safe)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return {"n": 0, "mean": None, "ci": [None, None]}
    lo, hi = bootstrap_ci(x, n_resamples=n_resamples, alpha=alpha, seed=seed)
    return {"n": int(x.size), "mean": float(x.mean()), "ci": [lo, hi]}
