"""Building the retriever's indexes from a wiki-18 style corpus, with progress and resume.

Layout under one index root (``prorag index`` writes it; the engine reads it through
:mod:`services.retriever.docstore`, never importing this module)::

    docstore/  offsets.npy ids.npy ids_sorted.npy ids_order.npy meta.json
    dense/     emb/manifest.json emb/shard-00000.npy ... index.faiss meta.json
    bm25/      bm25s files, tokenizer vocab + stopwords, meta.json

Row ``i`` is the ``i``-th non-blank line of the corpus in every one of them. Each
artifact is written atomically and ``meta.json`` comes last, so a directory either
holds a finished index or is visibly unfinished. A build whose ``meta.json`` already
matches the corpus sha256 and the config does nothing; an interrupted dense build
resumes from its finished embedding shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from prorag.config import cfg_field, to_dict
from prorag.data.loaders import Document
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound
from prorag.io import atomic_dir, atomic_path, write_json

from .docstore import parse_row, read_json, read_meta
from .encoders import Encoder, EncoderConfig, import_bm25s, make_bm25_tokenizer, resolve_use_gpu

#: progress(stage, done, total); stages: scan, docstore, embed, train, add, write, bm25-tokenize, bm25-index
Progress = Callable[[str, int, int], None]

FORMAT_VERSION = 1
_MIN_PER_CENTROID = 39  # below this many training points per centroid faiss k-means degrades (and warns)


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress is not None:
        progress(stage, done, total)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _key(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- corpus scan

@dataclasses.dataclass(frozen=True)
class CorpusScan:
    path: Path
    sha256: str
    size: int
    offsets: np.ndarray  # int64 start of each non-blank line

    @property
    def n_docs(self) -> int:
        return len(self.offsets)


_scan_cache: dict[tuple, CorpusScan] = {}
_scan_lock = threading.Lock()


def scan_corpus(corpus_path: str | Path, progress: Progress | None = None) -> CorpusScan:
    """sha256 and line offsets of a jsonl corpus in one streaming pass.

    Cached in-process by (path, size, mtime) so ``build_all`` reads a 13 GB corpus once.
    """
    path = Path(corpus_path).resolve()
    if not path.is_file():
        raise NotFound(f"corpus {corpus_path} does not exist")
    if path.suffix == ".gz":
        raise InvalidArgument(f"corpus {corpus_path} is gzipped; the doc store seeks into it, so decompress it first")
    st = path.stat()
    ck = (str(path), st.st_size, st.st_mtime_ns)
    with _scan_lock:
        if ck in _scan_cache:
            return _scan_cache[ck]
    h = hashlib.sha256()
    newlines = []
    base = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 23):
            h.update(block)
            newlines.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + base)
            base += len(block)
            _report(progress, "scan", base, st.st_size)
        nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
        starts = np.concatenate([[0], nl + 1])
        ends = np.concatenate([nl, [base]])
        keep = ends > starts
        # Whitespace-only lines are blank too; only short lines can be, so only those are read.
        for i in np.flatnonzero(keep & (ends - starts < 16)):
            fh.seek(starts[i])
            if not fh.read(int(ends[i] - starts[i])).strip():
                keep[i] = False
    scan = CorpusScan(path=path, sha256=h.hexdigest(), size=base, offsets=starts[keep].astype(np.int64))
    with _scan_lock:
        _scan_cache.clear()  # one corpus at a time is the common case; don't pin old offsets
        _scan_cache[ck] = scan
    return scan


def _scan_documents(corpus_path: str | Path, progress: Progress | None) -> CorpusScan:
    # an index needs something to search: an empty corpus is the caller's mistake, refused before any work
    scan = scan_corpus(corpus_path, progress)
    if scan.n_docs == 0:
        raise InvalidArgument(f"corpus {corpus_path} has no documents")
    return scan


def read_docs(scan: CorpusScan, start: int, stop: int) -> list[Document]:
    """Documents ``start..stop-1`` with one contiguous read."""
    if stop <= start:
        return []
    # Only this range's line ends: rebuilding them for the whole corpus per call is O(n_docs).
    starts = scan.offsets[start:stop]
    tail = [scan.size] if stop >= scan.n_docs else []
    ends = np.append(scan.offsets[start + 1:stop + 1], np.array(tail, dtype=np.int64))
    lo, hi = int(starts[0]), int(ends[-1])
    with open(scan.path, "rb") as fh:
        fh.seek(lo)
        buf = fh.read(hi - lo)
    return [parse_row(buf[int(a) - lo:int(b) - lo], f"{scan.path} row {i}")
            for i, a, b in zip(range(start, stop), starts, ends)]


# ----------------------------------------------------------------------------- doc store

def _corpus_relpath(corpus: Path, docstore_dir: Path) -> str:
    """The corpus as seen from the doc store's directory: what still finds it when the tree both live in (a data
    volume, PRORAG_HOME) is mounted or copied somewhere else."""
    return os.path.relpath(corpus, Path(docstore_dir).resolve())


def build_docstore(corpus_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> dict:
    """Write ``out_dir`` (offsets + ids); a no-op when it already matches the corpus."""
    out_dir = Path(out_dir)
    scan = scan_corpus(corpus_path, progress)
    meta = read_meta(out_dir)
    if meta and meta.get("corpus_sha256") == scan.sha256 and meta.get("format_version") == FORMAT_VERSION:
        rel = _corpus_relpath(scan.path, out_dir)
        if meta.get("corpus_path") != str(scan.path) or meta.get("corpus_relpath") != rel:
            # same bytes, moved file: only the pointers change
            meta["corpus_path"], meta["corpus_relpath"] = str(scan.path), rel
            write_json(out_dir / "meta.json", meta)
        return meta
    if scan.n_docs == 0:
        raise InvalidArgument(f"corpus {corpus_path} has no documents")
    t0 = time.time()
    ids: list[bytes] = []
    step = 50_000
    for start in range(0, scan.n_docs, step):
        stop = min(start + step, scan.n_docs)
        ids.extend(d.id.encode() for d in read_docs(scan, start, stop))
        _report(progress, "docstore", stop, scan.n_docs)
    arr = np.array(ids, dtype=bytes)  # fixed width 'S<longest>'
    order = np.argsort(arr, kind="stable")
    sorted_ids = arr[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if len(dup):
        first = sorted_ids[dup[0]].decode()
        raise InvalidArgument(f"corpus {corpus_path} repeats document id {first!r}; ids must be unique")
    meta = {"kind": "docstore", "format_version": FORMAT_VERSION, "n_docs": scan.n_docs,
            "corpus_path": str(scan.path), "corpus_relpath": _corpus_relpath(scan.path, out_dir),
            "corpus_size": scan.size, "corpus_sha256": scan.sha256, "build_seconds": round(time.time() - t0, 3),
            "created_at": _now()}
    with atomic_dir(out_dir) as tmp:
        np.save(tmp / "offsets.npy", scan.offsets)
        np.save(tmp / "ids.npy", arr)
        np.save(tmp / "ids_sorted.npy", sorted_ids)
        np.save(tmp / "ids_order.npy", order.astype(np.int64))
        write_json(tmp / "meta.json", meta)
    return meta


# ----------------------------------------------------------------------------- dense

@dataclasses.dataclass
class DenseIndexConfig:
    encoder: EncoderConfig = cfg_field(help="how passages and queries are embedded", factory=EncoderConfig)
    faiss_type: str = cfg_field("flat", help="flat = exact; hnsw = graph, fast on CPU; ivfpq = compressed "
                                "(wiki-18 in a few GB)",
                                choices=("flat", "hnsw", "ivfpq"))
    hnsw_m: int = cfg_field(32, help="HNSW neighbours per node (memory vs recall)", min=4, max=256)
    hnsw_ef_construction: int = cfg_field(200, help="HNSW build-time beam width", min=8, max=4096)
    hnsw_ef_search: int = cfg_field(128, help="HNSW search-time beam width (default for the server)", min=1, max=8192)
    ivf_nlist: int = cfg_field(0, help="IVF cells; 0 = 4*sqrt(n_docs), clamped to what the corpus can train", min=0)
    pq_m: int = cfg_field(0, help="PQ sub-vectors (must divide dim); 0 = dim/8", min=0, max=1024)
    pq_nbits: int = cfg_field(8, help="bits per PQ code (lowered for corpora too small to train 2^nbits centroids)",
                              min=4, max=12)
    nprobe: int = cfg_field(32, help="IVF cells visited per query (default for the server)", min=1, max=65536)
    train_size: int = cfg_field(0, help="IVF-PQ training sample; 0 = auto (64 per centroid, at most 1M)", min=0)
    shard_size: int = cfg_field(20_000, help="documents per embedding shard: the unit of resume after a crash", min=1)
    store_fp16: bool = cfg_field(False, help="flat/hnsw: keep vectors as fp16 (half the memory, tiny recall loss)")
    use_gpu: str = cfg_field("auto", help="faiss on GPU for training/search when the faiss build supports it",
                             choices=("auto", "true", "false"))
    keep_shards: bool = cfg_field(True, help="keep emb/ after the build (lets another faiss type reuse the embeddings)")
    seed: int = cfg_field(0, help="training sample seed")

    def embed_key(self) -> dict:
        """What the shards depend on."""
        return {"encoder": self.encoder.identity(), "shard_size": self.shard_size}

    def index_key(self) -> dict:
        """What the finished index depends on (search-time knobs and devices excluded)."""
        c = to_dict(self)
        for k in ("hnsw_ef_search", "nprobe", "use_gpu", "keep_shards", "encoder", "shard_size"):
            c.pop(k)
        return {**self.embed_key(), **c}


def _shard_path(emb: Path, s: int) -> Path:
    return emb / f"shard-{s:05d}.npy"


def _valid_shard(path: Path, rows: int, dim: int | None) -> bool:
    try:
        a = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return False
    return a.dtype == np.float32 and a.ndim == 2 and a.shape[0] == rows and (dim is None or a.shape[1] == dim)


def _clear_index_files(out_dir: Path) -> None:
    for name in ("meta.json", "index.faiss"):
        (out_dir / name).unlink(missing_ok=True)


def _embed_corpus(scan: CorpusScan, out_dir: Path, cfg: DenseIndexConfig, encoder: Encoder | None,
                  progress: Progress | None) -> tuple[list[Path], int, str]:
    """Encode missing shards; return (shard paths, dim, model id)."""
    emb = out_dir / "emb"
    key = {"corpus_sha256": scan.sha256, **cfg.embed_key()}
    manifest = read_json(emb / "manifest.json")
    if manifest is None or manifest.get("key") != key:
        # Shards from another corpus or encoder are useless; start over cleanly.
        shutil.rmtree(emb, ignore_errors=True)
        manifest = None
    n, S = scan.n_docs, cfg.shard_size
    n_shards = math.ceil(n / S)
    dim = manifest.get("dim") if manifest else None
    model_id = manifest.get("model_id") if manifest else None
    todo = [s for s in range(n_shards) if not _valid_shard(_shard_path(emb, s), min(S, n - s * S), dim)]
    done = n - sum(min(S, n - s * S) for s in todo)
    _report(progress, "embed", done, n)
    if todo:
        if encoder is None:
            encoder = Encoder(cfg.encoder)
        elif encoder.cfg.identity() != cfg.encoder.identity():
            raise InvalidArgument("the encoder passed in does not match cfg.encoder")
        if dim is not None and encoder.dim != dim:
            shutil.rmtree(emb, ignore_errors=True)
            return _embed_corpus(scan, out_dir, cfg, encoder, progress)
        dim, model_id = encoder.dim, encoder.model_id
        emb.mkdir(parents=True, exist_ok=True)
        write_json(emb / "manifest.json", {"key": key, "dim": dim, "model_id": model_id, "n_docs": n})
        chunk = max(encoder.cfg.batch_size * 4, 256)  # progress granularity inside a shard
        for s in todo:
            lo, hi = s * S, min(n, (s + 1) * S)
            parts = []
            for a in range(lo, hi, chunk):
                b = min(hi, a + chunk)
                parts.append(encoder.encode_docs([d.contents for d in read_docs(scan, a, b)]))
                done += b - a
                if b < hi:  # the shard's last report comes only after its file is safely written
                    _report(progress, "embed", done, n)
            with atomic_path(_shard_path(emb, s)) as tmp, open(tmp, "wb") as fh:
                np.save(fh, np.concatenate(parts).astype(np.float32, copy=False))
            _report(progress, "embed", done, n)
    return [_shard_path(emb, s) for s in range(n_shards)], int(dim), str(model_id)


def _gather_rows(shards: list[Path], rows: np.ndarray) -> np.ndarray:
    """Gather sorted global row indices from the shards."""
    out, base = [], 0
    for p in shards:
        a = np.load(p, mmap_mode="r")
        sel = rows[(rows >= base) & (rows < base + len(a))] - base
        if len(sel):
            out.append(np.asarray(a[sel]))
        base += len(a)
    return np.concatenate(out)


def _auto_pq_m(dim: int) -> int:
    # Sub-vectors of ~8 dims: the usual accuracy/size balance; must divide dim.
    divisors = [m for m in range(1, dim + 1) if dim % m == 0]
    return min(divisors, key=lambda m: (abs(dim / m - 8), m))


def _plan_faiss(cfg: DenseIndexConfig, n: int, dim: int) -> tuple[str, str, dict, list[str]]:
    """(actual type, faiss factory string, params, notes) for n vectors of this dim."""
    notes: list[str] = []
    kind = cfg.faiss_type
    params: dict = {}
    if kind == "ivfpq":
        nbits = cfg.pq_nbits
        while nbits > 4 and n < _MIN_PER_CENTROID * 2 ** nbits:
            nbits -= 1
        if n < _MIN_PER_CENTROID * 2 ** nbits:
            notes.append(f"ivfpq needs at least {_MIN_PER_CENTROID * 16} documents to train; "
                         f"{n} documents got an exact flat index instead (small enough anyway)")
            kind = "flat"
        else:
            if nbits != cfg.pq_nbits:
                notes.append(f"pq_nbits lowered {cfg.pq_nbits} -> {nbits}: {n} documents cannot train "
                             f"2^{cfg.pq_nbits} centroids per sub-quantizer")
            m = cfg.pq_m or _auto_pq_m(dim)
            if dim % m:
                raise InvalidArgument(f"pq_m={m} must divide the embedding dim {dim}")
            want = cfg.ivf_nlist or int(round(4 * math.sqrt(n)))
            nlist = max(1, min(want, n // _MIN_PER_CENTROID))
            if nlist != want:
                notes.append(f"ivf_nlist clamped {want} -> {nlist} so each cell has "
                             f">= {_MIN_PER_CENTROID} training points")
            centroids = max(nlist, 2 ** nbits)
            train = cfg.train_size or min(n, max(_MIN_PER_CENTROID * centroids, min(1_000_000, 64 * centroids)))
            train = min(n, max(train, _MIN_PER_CENTROID * centroids))
            params = {"nlist": nlist, "pq_m": m, "pq_nbits": nbits, "nprobe": min(cfg.nprobe, nlist),
                      "train_size": train}
            # "np": skip polysemous training, which only serves Hamming-filtered search and costs minutes.
            return kind, f"IVF{nlist},PQ{m}x{nbits}np", params, notes
    if kind == "hnsw":
        params = {"hnsw_m": cfg.hnsw_m, "ef_construction": cfg.hnsw_ef_construction, "ef_search": cfg.hnsw_ef_search,
                  "store_fp16": cfg.store_fp16}
        return kind, f"HNSW{cfg.hnsw_m}" + (",SQfp16" if cfg.store_fp16 else ""), params, notes
    params = {"store_fp16": cfg.store_fp16}
    return "flat", "SQfp16" if cfg.store_fp16 else "Flat", params, notes


def build_dense_index(corpus_path: str | Path, out_dir: str | Path, cfg: DenseIndexConfig | None = None,
                      progress: Progress | None = None, *, encoder: Encoder | None = None) -> dict:
    """Embed the corpus in resumable shards, then build ``index.faiss`` + ``meta.json``.

    ``encoder`` lets a caller reuse a loaded model (it must match ``cfg.encoder``).
    Returns the meta dict; a no-op when ``out_dir/meta.json`` matches corpus and config.
    """
    import faiss

    cfg = cfg or DenseIndexConfig()
    out_dir = Path(out_dir)
    t0 = time.time()
    scan = _scan_documents(corpus_path, progress)
    key = _key({"corpus_sha256": scan.sha256, **cfg.index_key()})
    meta = read_meta(out_dir)
    if meta and meta.get("config_key") == key and (out_dir / "index.faiss").is_file():
        search = {"nprobe": cfg.nprobe, "ef_search": cfg.hnsw_ef_search}
        if meta.get("search_defaults") != search:  # search-time knobs need no rebuild
            meta["search_defaults"] = search
            write_json(out_dir / "meta.json", meta)
        return meta
    _clear_index_files(out_dir)  # mid-rebuild the directory must not look finished
    shards, dim, model_id = _embed_corpus(scan, out_dir, cfg, encoder, progress)
    n = scan.n_docs

    kind, factory, params, notes = _plan_faiss(cfg, n, dim)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        faiss.downcast_index(index).hnsw.efConstruction = cfg.hnsw_ef_construction
    on_gpu = False
    if kind == "ivfpq":
        on_gpu = resolve_use_gpu(cfg.use_gpu)
        if on_gpu:
            try:
                index = faiss.index_cpu_to_all_gpus(index)
            except RuntimeError as e:  # e.g. a PQ size the GPU kernels lack
                if cfg.use_gpu == "true":
                    raise FailedPrecondition(f"faiss GPU cannot hold {factory}: {e}") from None
                notes.append(f"GPU training skipped ({e}); trained on CPU")
                on_gpu = False
        rng = np.random.default_rng(cfg.seed)
        sample = np.sort(rng.choice(n, size=params["train_size"], replace=False))
        _report(progress, "train", 0, 1)
        index.train(_gather_rows(shards, sample))
        _report(progress, "train", 1, 1)
    added = 0
    _report(progress, "add", 0, n)
    for p in shards:
        a = np.ascontiguousarray(np.load(p, mmap_mode="r"))
        index.add(a)
        added += len(a)
        _report(progress, "add", added, n)
    if on_gpu:
        index = faiss.index_gpu_to_cpu(index)

    _report(progress, "write", 0, 1)
    with atomic_path(out_dir / "index.faiss") as tmp:
        faiss.write_index(index, str(tmp))
    enc = cfg.encoder
    meta = {
        "kind": "dense", "format_version": FORMAT_VERSION,
        "encoder": {"model": enc.model, "model_id": model_id, "pooling": enc.pooling, "query_prefix": enc.query_prefix,
                    "doc_prefix": enc.doc_prefix, "max_length": enc.max_length, "normalize": enc.normalize,
                    "fp16": enc.fp16},
        "dim": dim, "n_docs": n, "faiss_type": kind, "requested_faiss_type": cfg.faiss_type,
        "faiss_factory": factory, "metric": "inner_product", "params": params, "notes": notes,
        "search_defaults": {"nprobe": cfg.nprobe, "ef_search": cfg.hnsw_ef_search},
        "corpus_path": str(scan.path), "corpus_sha256": scan.sha256, "config": to_dict(cfg), "config_key": key,
        "build_seconds": round(time.time() - t0, 3), "trained_on_gpu": on_gpu,
        "created_at": _now(),
    }
    write_json(out_dir / "meta.json", meta)
    _report(progress, "write", 1, 1)
    if not cfg.keep_shards:
        shutil.rmtree(out_dir / "emb", ignore_errors=True)
    return meta


# ----------------------------------------------------------------------------- BM25

@dataclasses.dataclass
class BM25Config:
    k1: float = cfg_field(0.9, help="term-frequency saturation (Anserini default 0.9)", min=0.0, max=10.0)
    b: float = cfg_field(0.4, help="length normalisation (Anserini default 0.4)", min=0.0, max=1.0)
    method: str = cfg_field("lucene", help="BM25 variant (bm25s)",
                            choices=("lucene", "robertson", "atire", "bm25l", "bm25+"))
    stopwords: str = cfg_field("en", help="stopword list removed before indexing", choices=("en", "none"))
    stemmer: str = cfg_field("none", help="'english' needs PyStemmer installed", choices=("none", "english"))


def build_bm25_index(corpus_path: str | Path, out_dir: str | Path, cfg: BM25Config | None = None,
                     progress: Progress | None = None) -> dict:
    """Tokenise title + text and index with bm25s into ``out_dir`` (one atomic directory swap)."""
    bm25s = import_bm25s()

    cfg = cfg or BM25Config()
    out_dir = Path(out_dir)
    t0 = time.time()
    scan = _scan_documents(corpus_path, progress)
    key = _key({"corpus_sha256": scan.sha256, "format_version": FORMAT_VERSION, **to_dict(cfg)})
    meta = read_meta(out_dir)
    if meta and meta.get("config_key") == key:
        return meta
    tok = make_bm25_tokenizer(cfg.stopwords, cfg.stemmer)
    ids: list[list[int]] = []
    step = 20_000
    for start in range(0, scan.n_docs, step):
        stop = min(start + step, scan.n_docs)
        texts = [f"{d.title} {d.text}" for d in read_docs(scan, start, stop)]
        ids.extend(tok.tokenize(texts, update_vocab=True, return_as="ids", show_progress=False))
        _report(progress, "bm25-tokenize", stop, scan.n_docs)
    _report(progress, "bm25-index", 0, 1)
    model = bm25s.BM25(k1=cfg.k1, b=cfg.b, method=cfg.method)
    model.index(bm25s.tokenization.Tokenized(ids=ids, vocab=tok.get_vocab_dict()), show_progress=False)
    del ids
    _report(progress, "bm25-index", 1, 1)
    meta = {"kind": "bm25", "format_version": FORMAT_VERSION, "n_docs": scan.n_docs,
            "vocab_size": len(tok.get_vocab_dict()),
            "config": to_dict(cfg), "config_key": key, "corpus_path": str(scan.path), "corpus_sha256": scan.sha256,
            "build_seconds": round(time.time() - t0, 3), "created_at": _now()}
    with atomic_dir(out_dir) as tmp:
        model.save(str(tmp), show_progress=False)
        tok.save_vocab(str(tmp))
        tok.save_stopwords(str(tmp))
        write_json(tmp / "meta.json", meta)
    return meta


def build_all(corpus_path: str | Path, index_root: str | Path, dense_cfg: DenseIndexConfig | None = None,
              bm25_cfg: BM25Config | None = None, progress: Progress | None = None, *, dense: bool = True,
              bm25: bool = True, dense_name: str = "dense", encoder: Encoder | None = None) -> dict:
    """Doc store + dense + BM25 under ``index_root`` (what `prorag index` runs); each step no-ops when current.

    Returns ``{"docstore": meta, dense_name: meta, "bm25": meta}``.
    """
    if dense_name != "dense" and not dense_name.startswith("dense-"):
        raise InvalidArgument(f"dense index name must be 'dense' or 'dense-<variant>', got {dense_name!r}")
    root = Path(index_root)
    out = {"docstore": build_docstore(corpus_path, root / "docstore", progress)}
    if dense:
        out[dense_name] = build_dense_index(corpus_path, root / dense_name, dense_cfg or DenseIndexConfig(), progress,
                                            encoder=encoder)
    if bm25:
        out["bm25"] = build_bm25_index(corpus_path, root / "bm25", bm25_cfg or BM25Config(), progress)
    return out
