"""The PRM engine's forward passes: rows cut by length so that padding stays within its bound, scores unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prorag.config import ConfigError, from_dict
from prorag.data.loaders import Document
from prorag.modeling import save_pretrained
from prorag.prm.model import prm_from_policy
from prorag.trajectory import Step
from services.prm import engine as engine_module
from services.prm.engine import CPU_BATCH_PADDING, PRMEngine, ScoringItem, length_batches
from services.prm.server import PRMServeConfig, engine_workers


def test_length_batches_bounds_padding_and_tokens_and_keeps_the_order():
    lengths = [50, 50, 52, 60, 90, 100, 400]
    chunks = length_batches(lengths, max_tokens=10_000, max_padding=1.1)
    assert [i for c in chunks for i in c] == list(range(len(lengths)))  # every row once, in order
    for c in chunks:
        padded, real = len(c) * max(lengths[i] for i in c), sum(lengths[i] for i in c)
        assert padded <= 1.1 * real
    assert chunks == [[0, 1, 2], [3], [4, 5], [6]]
    assert length_batches([10] * 5, max_tokens=25, max_padding=1.0) == [[0, 1], [2, 3], [4]]  # the token bound
    assert length_batches([300], max_tokens=100, max_padding=1.0) == [[0]]  # too long for a pass: runs alone
    assert length_batches([10, 20], max_tokens=1000, max_padding=float("inf")) == [[0, 1]]
    assert length_batches([], max_tokens=10, max_padding=1.0) == []
    with pytest.raises(ValueError, match="ascending"):
        length_batches([20, 10], max_tokens=100, max_padding=1.0)
    with pytest.raises(ValueError, match="at least the real ones"):
        length_batches([10], max_tokens=100, max_padding=0.5)


def _items(n: int) -> list[ScoringItem]:
    items = []
    for k in range(n):
        doc = Document(id=f"d{k}", title=f"Brewery {k}", text=f"Brewery {k} was founded by Tova Lunn {'and ' * k}x.",
                       contents=f'"Brewery {k}"\nBrewery {k} was founded by Tova Lunn {"and " * k}x.')
        steps = [Step("subquery", thought="First the founder.", content=f"Who founded Brewery {k}?", docs=[doc]),
                 Step("subanswer", thought="The document says.", content="Tova Lunn"),
                 Step("answer", thought="Done.", content="Tova Lunn")][:2 + k % 2]
        items.append(ScoringItem(f"Who founded Brewery {k}?", steps))
    return items


def test_padding_bound_changes_the_passes_not_the_scores(tiny_policy, tmp_path, monkeypatch):
    model_dir, _ = tiny_policy
    prm, tok = prm_from_policy(model_dir, seed=1)
    save_pretrained(prm, tok, tmp_path / "prm")
    passes: list[int] = []
    real_score_batch = engine_module.score_batch

    def counting(model, seqs, *args, **kwargs):
        passes.append(len(seqs))
        return real_score_batch(model, seqs, *args, **kwargs)

    monkeypatch.setattr(engine_module, "score_batch", counting)
    items = _items(8)  # rows of eight different lengths
    tight = PRMEngine(tmp_path / "prm")  # a CPU: rows of equal length only
    assert tight.max_batch_padding == CPU_BATCH_PADDING == 1.0
    scored_tight = [s for _, s in tight.score(items)]
    tight_passes, passes[:] = list(passes), []
    loose = PRMEngine(tmp_path / "prm", max_batch_padding=float("inf"))
    scored_loose = [s for _, s in loose.score(items)]
    assert passes == [8] and tight_passes == [1] * 8  # one padded pass against one pass per length
    for a, b in zip(scored_tight, scored_loose):
        assert a == pytest.approx(b, abs=1e-5)  # right padding without a mask changes no real position's score


def test_the_service_config_refuses_a_padding_bound_below_one():
    with pytest.raises(ConfigError, match="max_batch_padding"):
        from_dict(PRMServeConfig, {"model": "prm", "max_batch_padding": 0.5})
    assert from_dict(PRMServeConfig, {"model": "prm", "max_batch_padding": 1.5}).max_batch_padding == 1.5


def test_calls_from_several_threads_at_once_score_as_calls_one_after_another(tiny_policy, tmp_path):
    """The service runs engine_workers calls at once on one engine: each must get what it gets alone."""
    model_dir, _ = tiny_policy
    prm, tok = prm_from_policy(model_dir, seed=1)
    save_pretrained(prm, tok, tmp_path / "prm")
    engine = PRMEngine(tmp_path / "prm")
    batches = [_items(8)[k::4] for k in range(4)]
    alone = [engine.score(b) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(engine.score, batches * 3))
    for got, want in zip(together, alone * 3):
        assert [v for v, _ in got] == [v for v, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, abs=1e-5)


def test_engine_workers_share_the_threads_and_a_gpu_runs_one_call(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    cfg = from_dict(PRMServeConfig, {"model": "prm"})
    assert engine_workers(cfg, "cpu") == (4, 2)  # one per thread, up to 4
    assert engine_workers(cfg, "cuda:0") == (1, 8)  # one device: one merged call at a time
    assert engine_workers(from_dict(PRMServeConfig, {"model": "prm", "engine_workers": 3}), "cpu") == (3, 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert engine_workers(cfg, "cpu") == (1, 1)
