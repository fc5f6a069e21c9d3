import copy
import json
import os
import shutil

import faiss
import numpy as np
import pytest

from prorag.config import ConfigError, from_dict
from prorag.data.loaders import parse_contents
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound
from services.retriever.docstore import DocStore
from services.retriever.indexing import (BM25Config, DenseIndexConfig, build_bm25_index, build_dense_index,
                                         build_docstore, scan_corpus)

from .conftest import SHARD, codes, make_rows, paraphrases, topic_ids, write_corpus


def counting(encoder):
    """A copy of the encoder (same model) that records how many passages it embeds."""
    seen = []
    c = copy.copy(encoder)
    c.encode_docs = lambda docs: (seen.append(len(docs)), encoder.encode_docs(docs))[1]
    return c, seen


def recall_at_1(results, gold):
    return sum(bool(r) and r[0].id == g for r, g in zip(results, gold)) / len(gold)


# ----------------------------------------------------------------------------- doc store

def test_docstore_by_index_and_id(index_root, corpus_rows):
    ds = DocStore(index_root / "docstore")
    assert len(ds) == len(corpus_rows)  # the blank lines in the file are not rows
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        d = ds.get(i)
        row = corpus_rows[i]
        assert d.id == row["id"] and d.contents == row["contents"]
        assert (d.title, d.text) == parse_contents(row["contents"])
        assert ds.get_by_id(row["id"]) == d and ds.index_of(row["id"]) == i
    with pytest.raises(NotFound, match="unknown document id"):
        ds.get_by_id("no-such-doc")
    with pytest.raises(NotFound, match="out of range"):
        ds.get(len(ds))


def test_scan_and_docstore_errors(tmp_path):
    rows = make_rows(n_filler=3)
    with pytest.raises(NotFound):
        scan_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "c.jsonl.gz").write_bytes(b"")
    with pytest.raises(InvalidArgument, match="decompress"):
        scan_corpus(tmp_path / "c.jsonl.gz")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert scan_corpus(empty).n_docs == 0
    with pytest.raises(InvalidArgument, match="no documents"):
        build_docstore(empty, tmp_path / "ds0")
    dup = write_corpus(tmp_path / "dup.jsonl", rows + [rows[0]], blank_lines=False)
    with pytest.raises(InvalidArgument, match="repeats document id"):
        build_docstore(dup, tmp_path / "ds1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(InvalidArgument, match="row 1: not valid JSON"):
        build_docstore(bad, tmp_path / "ds2")
    assert not (tmp_path / "ds2").exists()  # nothing half-built left behind
    parts = tmp_path / "parts.jsonl"  # FlashRAG/BEIR rows with title/text fields
    parts.write_text(json.dumps({"id": 7, "title": "T", "text": "body"}) + "\n")
    build_docstore(parts, tmp_path / "ds3")
    d = DocStore(tmp_path / "ds3").get_by_id("7")
    assert (d.title, d.text, d.contents) == ("T", "body", '"T"\nbody')


def test_docstore_follows_a_moved_corpus(tmp_path):
    rows = make_rows(n_filler=3)
    a = write_corpus(tmp_path / "a.jsonl", rows)
    m1 = build_docstore(a, tmp_path / "ds")
    b = tmp_path / "b.jsonl"
    b.write_bytes(a.read_bytes())
    a.unlink()
    m2 = build_docstore(b, tmp_path / "ds")
    assert m2["corpus_path"] == str(b.resolve()) and m2["created_at"] == m1["created_at"]
    assert DocStore(tmp_path / "ds").get(0).id == rows[0]["id"]


def test_docstore_finds_its_corpus_when_the_whole_tree_moves(tmp_path):
    # a data volume mounted at another path (or PRORAG_HOME copied elsewhere): the absolute path recorded at build
    # time is gone, the corpus next to the doc store is still where it was relative to it
    rows = make_rows(n_filler=3)
    old = tmp_path / "old"
    (old / "data" / "corpora").mkdir(parents=True)
    corpus = write_corpus(old / "data" / "corpora" / "c.jsonl", rows)
    meta = build_docstore(corpus, old / "data" / "indexes" / "c" / "docstore")
    assert meta["corpus_relpath"] == "../../../corpora/c.jsonl"
    shutil.move(old, tmp_path / "new")
    store = DocStore(tmp_path / "new" / "data" / "indexes" / "c" / "docstore")
    assert store.corpus_path == (tmp_path / "new" / "data" / "corpora" / "c.jsonl").resolve()
    assert store.get(0).id == rows[0]["id"]
    (tmp_path / "new" / "data" / "corpora" / "c.jsonl").unlink()  # gone from both places: the error names it
    with pytest.raises(FailedPrecondition, match="which is missing"):
        DocStore(tmp_path / "new" / "data" / "indexes" / "c" / "docstore")


# ----------------------------------------------------------------------------- dense

@pytest.mark.parametrize("name,threshold", [("dense", 0.9), ("dense-hnsw", 0.9), ("dense-ivfpq", 0.75)])
def test_dense_finds_paraphrased_topics(engine, name, threshold):
    r = recall_at_1(engine.search(paraphrases(), 5, name), topic_ids())
    assert r >= threshold, f"{name}: rank-1 recall {r:.2f} < {threshold}"


def test_dense_meta(index_root, corpus_path):
    flat = json.loads((index_root / "dense" / "meta.json").read_text())
    assert flat["faiss_type"] == "flat" and flat["n_docs"] == 640 and flat["dim"] == 384
    assert flat["encoder"]["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert flat["corpus_sha256"] == scan_corpus(corpus_path).sha256 and flat["build_seconds"] > 0
    assert sorted(p.name for p in (index_root / "dense" / "emb").glob("shard-*.npy")) == [
        f"shard-{i:05d}.npy" for i in range(5)]
    pq = json.loads((index_root / "dense-ivfpq" / "meta.json").read_text())
    assert pq["faiss_type"] == "ivfpq" and pq["params"]["pq_nbits"] == 4 and pq["params"]["nlist"] == 16
    assert any("pq_nbits lowered" in n for n in pq["notes"])  # small corpus: said so, not silent
    assert json.loads((index_root / "dense-hnsw" / "meta.json").read_text())["faiss_factory"] == "HNSW32"


def test_tiny_corpus_ivfpq_falls_back_to_flat(tmp_path, encoder):
    corpus = write_corpus(tmp_path / "tiny.jsonl", make_rows(n_filler=10))
    meta = build_dense_index(corpus, tmp_path / "d", DenseIndexConfig(faiss_type="ivfpq"), encoder=encoder)
    assert meta["requested_faiss_type"] == "ivfpq" and meta["faiss_type"] == "flat"
    assert "flat index instead" in meta["notes"][0]


def test_resume_after_crash(tmp_path, encoder):
    corpus = write_corpus(tmp_path / "c.jsonl", make_rows(n_filler=60))  # 100 docs
    shard = 16
    cfg = DenseIndexConfig(shard_size=shard)
    out = tmp_path / "dense"

    def crash(stage, done, total):
        if stage == "embed" and done >= 2 * shard:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        build_dense_index(corpus, out, cfg, crash, encoder=encoder)
    assert sorted(p.name for p in (out / "emb").glob("*.npy")) == ["shard-00000.npy", "shard-00001.npy"]
    assert not (out / "meta.json").exists() and not (out / "index.faiss").exists()
    (out / "emb" / "shard-00002.npy").write_bytes(b"\x93NUMPY torn write")  # a torn file is not a finished shard

    enc, seen = counting(encoder)
    stages = []
    meta = build_dense_index(corpus, out, cfg, lambda s, d, t: stages.append((s, d, t)), encoder=enc)
    assert sum(seen) == 100 - 2 * shard  # shards 0 and 1 were skipped
    assert ("embed", 2 * shard, 100) in stages
    assert meta["n_docs"] == 100 and (out / "index.faiss").is_file()

    clean = tmp_path / "clean"
    build_dense_index(corpus, clean, cfg, encoder=encoder)
    for i in range(7):  # identical to an uninterrupted build
        name = f"shard-{i:05d}.npy"
        np.testing.assert_allclose(np.load(out / "emb" / name), np.load(clean / "emb" / name), atol=1e-6)
    # The index holds the same vectors as the clean build's, to float tolerance: not byte-equal, because
    # the encoder's matmuls may pick another kernel split (thread count, batch) between the two builds.
    resumed_index, clean_index = (faiss.read_index(str(d / "index.faiss")) for d in (out, clean))
    assert resumed_index.ntotal == clean_index.ntotal == 100
    np.testing.assert_allclose(resumed_index.reconstruct_n(0, 100), clean_index.reconstruct_n(0, 100), atol=1e-6)


def test_rebuild_is_noop_when_current(index_root, corpus_path, encoder):
    d = index_root / "dense"
    before = (d / "meta.json").read_text(), os.stat(d / "index.faiss").st_mtime_ns
    enc, seen = counting(encoder)
    stages = []
    meta = build_dense_index(corpus_path, d, DenseIndexConfig(shard_size=SHARD, use_gpu="false"),
                             lambda s, *_: stages.append(s), encoder=enc)
    assert seen == [] and not {"embed", "add", "write"} & set(stages)
    assert ((d / "meta.json").read_text(), os.stat(d / "index.faiss").st_mtime_ns) == before
    assert meta == json.loads(before[0])


def test_config_change_starts_over_and_search_knobs_do_not(tmp_path, encoder):
    corpus = write_corpus(tmp_path / "c.jsonl", make_rows(n_filler=10))  # 50 docs
    out = tmp_path / "d"
    build_dense_index(corpus, out, DenseIndexConfig(shard_size=8, faiss_type="hnsw"), encoder=encoder)
    assert len(list((out / "emb").glob("shard-*.npy"))) == 7
    mtime = os.stat(out / "index.faiss").st_mtime_ns
    meta = build_dense_index(corpus, out, DenseIndexConfig(shard_size=8, faiss_type="hnsw", hnsw_ef_search=16),
                             encoder=encoder)
    assert meta["search_defaults"]["ef_search"] == 16 and os.stat(out / "index.faiss").st_mtime_ns == mtime
    enc, seen = counting(encoder)
    meta = build_dense_index(corpus, out, DenseIndexConfig(shard_size=32, faiss_type="flat"), encoder=enc)
    assert sorted(p.name for p in (out / "emb").glob("*.npy")) == ["shard-00000.npy", "shard-00001.npy"]
    assert sum(seen) == 50 and meta["faiss_type"] == "flat"
    enc, seen = counting(encoder)  # another faiss type over the same shards: no re-encoding
    build_dense_index(corpus, out, DenseIndexConfig(shard_size=32, faiss_type="hnsw", store_fp16=True), encoder=enc)
    assert seen == []


def test_dense_config_is_strict():
    cfg = from_dict(DenseIndexConfig, {"faiss_type": "ivfpq", "encoder": {"query_prefix": "query: "}})
    assert cfg.encoder.query_prefix == "query: "
    with pytest.raises(ConfigError, match="faiss_type"):
        from_dict(DenseIndexConfig, {"faiss_type": "annoy"})
    with pytest.raises(ConfigError, match="encoder.pooling"):
        from_dict(DenseIndexConfig, {"encoder": {"pooling": "max"}})


# ----------------------------------------------------------------------------- BM25

def test_bm25_finds_keywords(engine):
    assert recall_at_1(engine.search(codes(), 3, "bm25"), topic_ids()) == 1.0
    res = engine.search(["Velmora lighthouse fog"], 3, "bm25")[0]
    assert res[0].id == "topic-0"


def test_bm25_noop_and_rebuild_on_config_change(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", make_rows(n_filler=10))
    out = tmp_path / "bm25"
    m1 = build_bm25_index(corpus, out)
    assert build_bm25_index(corpus, out) == m1
    m2 = build_bm25_index(corpus, out, BM25Config(k1=1.5, b=0.75))
    assert m2["config"]["k1"] == 1.5 and m2["config_key"] != m1["config_key"]
    assert json.loads((out / "meta.json").read_text()) == m2
