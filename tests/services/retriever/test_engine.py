import importlib.util
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from prorag.data.loaders import Document
from prorag.errors import FailedPrecondition, NotFound
from services.retriever import engine as engine_module
from services.retriever.engine import HybridRetriever, PyseriniBM25Retriever, RetrievalEngine, Retriever

from .conftest import codes, paraphrases, topic_ids

MIXED = paraphrases() + codes()
GOLD = topic_ids() * 2


def recall_at(results, k):
    return sum(any(d.id == g for d in r[:k]) for r, g in zip(results, GOLD)) / len(GOLD)


def mrr(results):
    return sum(next((1 / i for i, d in enumerate(r, 1) if d.id == g), 0.0) for r, g in zip(results, GOLD)) / len(GOLD)


def test_list_indexes(engine):
    info = {i["name"]: i for i in engine.list_indexes()}
    assert set(info) == {"dense", "dense-hnsw", "dense-ivfpq", "bm25", "hybrid"}
    assert [n for n, i in info.items() if i["is_default"]] == ["hybrid"]
    assert info["dense-hnsw"]["faiss_type"] == "hnsw" and info["dense"]["kind"] == "dense"
    assert info["hybrid"]["encoder"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["bm25"]["encoder"] == "" and info["bm25"]["kind"] == "bm25"
    assert all(i["num_documents"] == 640 for i in info.values())
    assert all(isinstance(v, str) for i in info.values() for v in i["extra"].values())
    # variants with the same encoder share one loaded model
    assert engine.indexes["dense"].encoder is engine.indexes["dense-ivfpq"].encoder


@pytest.mark.parametrize("name", ["dense", "dense-hnsw", "dense-ivfpq", "bm25", "hybrid"])
def test_results_are_scored_sorted_and_hydrated(engine, name):
    results = engine.search(["tower guiding ships", "QV-2291 registry"], 7, name)
    assert len(results) == 2
    for docs in results:
        assert 1 <= len(docs) <= 7
        assert [d.rank for d in docs] == list(range(1, len(docs) + 1))
        scores = [d.score for d in docs]
        assert scores == sorted(scores, reverse=True) and all(isinstance(s, float) for s in scores)
        for d in docs:
            stored = engine.docstore.get_by_id(d.id)
            assert (d.id, d.title, d.text, d.contents) == (stored.id, stored.title, stored.text, stored.contents)
            assert d.contents.startswith(f'"{d.title}"\n')  # the Search-R1 contents format


def test_hybrid_beats_each_part_on_mixed_queries(engine):
    dense, bm25, hybrid = (engine.search(MIXED, 10, n) for n in ("dense", "bm25", "hybrid"))
    for k in (5, 10):
        assert recall_at(hybrid, k) >= max(recall_at(dense, k), recall_at(bm25, k))
    assert mrr(hybrid) >= max(mrr(dense), mrr(bm25))
    weighted = HybridRetriever(engine.indexes["dense"], engine.indexes["bm25"], method="weighted", alpha=0.5)
    w = weighted.search(MIXED, 10)
    assert recall_at(w, 5) >= max(recall_at(dense, 5), recall_at(bm25, 5))
    assert all(0.0 <= d.score <= 1.0 for r in w for d in r)  # min-max normalised parts, weights sum to 1


def test_get_documents(engine):
    docs = engine.get_documents(["topic-3", "topic-0"])
    assert [d.id for d in docs] == ["topic-3", "topic-0"]
    assert docs[1].title == "Velmora Lighthouse" and "fishing boats" in docs[1].text
    assert engine.get_documents([]) == []
    with pytest.raises(NotFound, match="2 unknown document id.*'nope-1', 'nope-2'"):
        engine.get_documents(["topic-1", "nope-1", "nope-2"])


def test_concurrent_searches_match_sequential(engine):
    want = [[d.id for d in r] for r in engine.search(MIXED[:8], 5, "hybrid")]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: [[d.id for d in r] for r in engine.search(MIXED[:8], 5, "hybrid")], range(4)))
    assert all(g == want for g in got)


def test_from_dir_errors(tmp_path, index_root, encoder):
    with pytest.raises(FailedPrecondition, match="no finished doc store"):
        RetrievalEngine.from_dir(tmp_path)
    with pytest.raises(FailedPrecondition, match="default index 'hybrid' is not built"):
        root = tmp_path / "only-bm25"
        root.mkdir()
        shutil.copytree(index_root / "docstore", root / "docstore")
        shutil.copytree(index_root / "bm25", root / "bm25")
        RetrievalEngine.from_dir(root)
    e = RetrievalEngine.from_dir(root, default="bm25")
    assert [i["name"] for i in e.list_indexes()] == ["bm25"]
    assert isinstance(e.search(["QV-2291"], 1)[0][0], Document)


class ReversedBM25(Retriever):
    """A kind of index added by one class and one row of INDEX_KINDS: BM25's hits, worst first."""

    kind = "reversed-bm25"

    def __init__(self, inner):
        super().__init__(inner.docstore)
        self.inner = inner

    def search_raw(self, queries, k):
        return [list(reversed(hits)) for hits in self.inner.search_raw(queries, k)]


def test_index_kinds_come_from_the_registry(tmp_path, index_root, monkeypatch, caplog):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(index_root / "docstore", root / "docstore")
    shutil.copytree(index_root / "bm25", root / "bm25")
    (root / "bm25-reversed").mkdir()
    (root / "bm25-reversed" / "meta.json").write_text('{"kind": "reversed-bm25"}')
    (root / "half-built").mkdir()  # no meta.json: an interrupted build, skipped with a warning
    without = RetrievalEngine.from_dir(root, default="bm25")
    assert [i["name"] for i in without.list_indexes()] == ["bm25"]
    assert "index kind 'reversed-bm25' is not one this server opens" in caplog.text
    assert "half-built" in caplog.text

    def open_reversed(index_dir, opening):
        # the BM25 index beside it underneath (this kind's own directory only has to say its kind)
        return ReversedBM25(engine_module.open_bm25(index_dir.parent / "bm25", opening))

    monkeypatch.setitem(engine_module.INDEX_KINDS, "reversed-bm25", open_reversed)
    e = RetrievalEngine.from_dir(root, default="bm25")
    assert {i["name"]: i["kind"] for i in e.list_indexes()} == {"bm25": "bm25", "bm25-reversed": "reversed-bm25"}
    forward = [d.id for d in e.search(["QV-2291 registry"], 5, "bm25")[0]]
    assert [d.id for d in e.search(["QV-2291 registry"], 5, "bm25-reversed")[0]] == forward[::-1]


@pytest.mark.skipif(importlib.util.find_spec("pyserini") is not None, reason="pyserini installed")
def test_pyserini_missing_says_how_to_install(tmp_path):
    with pytest.raises(FailedPrecondition, match=r"pip install 'prorag\[pyserini\]'.*JDK 21"):
        PyseriniBM25Retriever(tmp_path)


def test_flat_matmul_path_matches_faiss(engine):
    """Batches of a CPU flat index are scored with torch's matmul + topk; same rows and scores as FAISS."""
    import numpy as np

    from services.retriever.engine import MATMUL_MIN_QUERIES

    dense = engine.indexes["dense"]
    assert dense._matrix is not None  # flat IP on CPU
    assert engine.indexes["dense-hnsw"]._matrix is None
    q = dense.encoder.encode_queries(MIXED)
    assert len(q) >= MATMUL_MIN_QUERIES
    scores, rows = dense.search_vectors(q, 5)
    want_scores, want_rows = dense.index.search(q, 5)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    # one query takes the FAISS path; its answer agrees with the same query inside a batch
    s1, r1 = dense.search_vectors(q[:1], 5)
    np.testing.assert_array_equal(r1[0], rows[0])
    np.testing.assert_allclose(s1[0], scores[0], atol=1e-5)
    # k larger than the corpus: every row once, best first
    s_all, r_all = dense.search_vectors(q, dense.index.ntotal + 10)
    assert r_all.shape == (len(q), dense.index.ntotal) and sorted(r_all[0].tolist()) == list(range(dense.index.ntotal))
    assert (np.diff(s_all, axis=1) <= 1e-6).all()
