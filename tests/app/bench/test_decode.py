"""prorag_app.bench.decode's limit: the bare batched forward pass runs on the engine's own model and prompts and
reports tokens/s of what it generated; bench_decode sets the engine's figure against it."""

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def engine(tiny_policy):
    from services.policy.engine import TransformersEngine

    return TransformersEngine(str(tiny_policy[0]), max_batch_size=64)


def test_bare_decode_counts_every_row_and_step(engine):
    from prorag_app.bench.decode import bare_decode_tokens_per_s

    rate = bare_decode_tokens_per_s(engine.base, [[5, 6, 7], [8, 9]], new_tokens=4, pad_id=engine.pad_id)
    assert rate > 0


def test_bench_decode_compares_the_engine_with_the_bare_forward_pass_at_one_batch_size(engine):
    from prorag_app.bench.decode import bench_decode

    qs = [SimpleNamespace(question=f"Who founded Kest {i}?") for i in range(3)]
    out = bench_decode(engine, qs, batch=6, new_tokens=8, repeats=1)
    assert out["batch"] == 6 and out["new_tokens"] == 8
    assert out["engine_tokens_per_s"] > 0 and out["bare_forward_tokens_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["engine_tokens_per_s"] / out["bare_forward_tokens_per_s"])
