"""Search over the built indexes: dense (FAISS), BM25 (bm25s), hybrid fusion, optional Lucene.

Every retriever answers a batch of queries with scored rows (higher = better); the
:class:`RetrievalEngine` picks the index by name and hydrates rows into documents
(:class:`prorag.data.loaders.Document`, with score and rank) from the shared
:class:`~services.retriever.docstore.DocStore`. Row indexes stay inside the engine. It holds
no transport code and checks no requests: the front end (:mod:`services.retriever.frontend`) checks
them for the gRPC and HTTP callers.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prorag.data.loaders import Document
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound

from .docstore import DocStore, read_meta
from .encoders import Encoder, EncoderConfig, import_bm25s, make_bm25_tokenizer, resolve_use_gpu

__all__ = ["Retriever", "DenseRetriever", "BM25Retriever", "HybridRetriever",
           "PyseriniBM25Retriever", "RetrievalEngine", "INDEX_KINDS", "IndexOpening"]

log = logging.getLogger(__name__)

Hits = list[list[tuple[int, float]]]  # per query: (row index, score), best first

#: from this many queries on, a CPU flat inner-product index is searched with torch's matmul + topk
#: (measured on 2 cores, 20k x 384: 64 queries 17 ms against FAISS's 52 ms single-threaded / 33 ms on
#: two threads; one query: FAISS 0.9 ms against 3 ms)
MATMUL_MIN_QUERIES = 8


class Retriever(abc.ABC):
    """Base: subclasses implement :meth:`search_raw`; :meth:`search` hydrates rows."""

    kind = ""

    def __init__(self, docstore: DocStore | None):
        self.docstore = docstore

    @property
    def num_documents(self) -> int:
        return len(self.docstore) if self.docstore is not None else 0

    @abc.abstractmethod
    def search_raw(self, queries: list[str], k: int) -> Hits:
        """[Q queries] -> [Q][<=k] (doc index, score), best first."""

    def search(self, queries: list[str], topk: int) -> list[list[Document]]:
        """[Q queries] -> [Q][<=topk] documents, best first, with score and 1-based rank."""
        return [[dataclasses.replace(self.docstore.get(i), score=float(s), rank=r) for r, (i, s) in enumerate(hits, 1)]
                for hits in self.search_raw(queries, topk)]

    def info(self) -> dict:
        return {"kind": self.kind, "num_documents": self.num_documents, "encoder": "", "faiss_type": "", "extra": {}}


def _encoder_cfg(meta: dict, device: str) -> EncoderConfig:
    """The query encoder an index was built with (its passage settings included, for identity checks)."""
    e = meta["encoder"]
    return EncoderConfig(model=e["model"], pooling=e["pooling"], query_prefix=e["query_prefix"],
                         doc_prefix=e["doc_prefix"], max_length=e["max_length"], normalize=e["normalize"],
                         fp16=e["fp16"], device=device)


def _check_same_corpus(meta: dict, docstore: DocStore, where: Path) -> None:
    if meta.get("corpus_sha256") != docstore.corpus_sha256 or meta.get("n_docs") != len(docstore):
        raise FailedPrecondition(
            f"{where} was built from a different corpus than the doc store {docstore.path}; "
            "rebuild both from one corpus with `prorag index`")


class DenseRetriever(Retriever):
    """A FAISS inner-product index plus the encoder it was built with."""

    kind = "dense"

    def __init__(self, index_dir: str | Path, docstore: DocStore, *, encoder: Encoder | None = None,
                 device: str = "auto", use_gpu: str = "auto", nprobe: int | None = None, ef_search: int | None = None,
                 faiss_threads: int = 0):
        import faiss

        super().__init__(docstore)
        self.path = Path(index_dir)
        meta = read_meta(self.path)
        if meta is None or meta.get("kind") != "dense" or not (self.path / "index.faiss").is_file():
            raise FailedPrecondition(f"{self.path} holds no finished dense index (no meta.json); run `prorag index`")
        _check_same_corpus(meta, docstore, self.path)
        self.meta = meta
        enc_cfg = _encoder_cfg(meta, device)
        if encoder is not None and encoder.cfg.identity() != enc_cfg.identity():
            raise InvalidArgument(f"the encoder passed in differs from the one {self.path} was built with")
        self.encoder = encoder or Encoder(enc_cfg)
        index = faiss.read_index(str(self.path / "index.faiss"))
        self.on_gpu = False
        if meta["faiss_type"] in ("flat", "ivfpq") and resolve_use_gpu(use_gpu):
            try:
                co = faiss.GpuMultipleClonerOptions()
                co.useFloat16 = True  # halves GPU memory: the flat-e5 OOM users hit
                co.shard = True  # split rows across GPUs instead of a full copy on each
                index = faiss.index_cpu_to_all_gpus(index, co)
                self.on_gpu = True
            except RuntimeError as err:
                if use_gpu == "true":
                    raise FailedPrecondition(f"cannot move {self.path} to GPU: {err}") from None
                log.warning("dense index %s stays on CPU: %s", self.path, err)
        defaults = meta.get("search_defaults", {})
        self.nprobe = min(nprobe or defaults.get("nprobe") or 1, meta["params"].get("nlist", 1 << 30))
        self.ef_search = ef_search or defaults.get("ef_search")
        ps = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        if meta["faiss_type"] == "ivfpq":
            ps.set_index_parameter(index, "nprobe", int(self.nprobe))
        elif meta["faiss_type"] == "hnsw":
            ps.set_index_parameter(index, "efSearch", int(self.ef_search))
        self.index = index
        # GPU indexes are not safe for concurrent searches; CPU ones gain nothing (OpenMP uses every core).
        self._lock = threading.Lock()
        self.faiss_threads = faiss_threads
        self._faiss_max_threads = faiss.omp_get_max_threads()
        # A flat inner-product index on CPU is one matrix: batches are scored with torch's matmul + topk on
        # the encoder's thread pool (a view of the index's own memory, no copy). FAISS brings its own OpenMP
        # runtime and OpenBLAS: a second thread pool whose spinning threads fight torch's for the same cores.
        self._matrix = None
        if (not self.on_gpu and type(index) is faiss.IndexFlatIP and index.ntotal > 0
                and self.encoder.device == "cpu"):
            import torch

            xb = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)
            self._matrix = torch.from_numpy(xb)

    def _faiss_search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        # One FAISS thread for a few queries unless asked otherwise: they do not pay for waking a team (one
        # query, 20k x 384 flat on 2 cores: 0.9 ms on one thread, 2.7-5.5 ms on two), and on a small or
        # shared machine a team waits on whichever of its threads the scheduler parked.
        faiss.omp_set_num_threads(self.faiss_threads or (1 if len(q) < 16 else self._faiss_max_threads))
        return self.index.search(q, k)

    def search_vectors(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """[Q, dim] float32 query vectors -> (scores [Q, k], rows [Q, k]), best first (-1 rows = no hit)."""
        k = min(k, self.index.ntotal)
        with self._lock:
            if self._matrix is not None and len(q) >= MATMUL_MIN_QUERIES:
                import torch

                with torch.inference_mode():
                    scores, rows = torch.topk(torch.from_numpy(q) @ self._matrix.T, k, dim=1)
                return scores.numpy(), rows.numpy()
            return self._faiss_search(q, k)

    def search_raw(self, queries: list[str], k: int) -> Hits:
        scores, rows = self.search_vectors(self.encoder.encode_queries(queries), k)
        return [[(i, s) for i, s in zip(r, sc) if i >= 0] for r, sc in zip(rows.tolist(), scores.tolist())]

    def info(self) -> dict:
        m = self.meta
        extra = {"faiss_factory": m["faiss_factory"], "dim": str(m["dim"]), "on_gpu": str(self.on_gpu).lower(),
                 "path": str(self.path)}
        if m["faiss_type"] == "ivfpq":
            extra["nprobe"] = str(self.nprobe)
        if m["faiss_type"] == "hnsw":
            extra["ef_search"] = str(self.ef_search)
        if m.get("notes"):
            extra["notes"] = "; ".join(m["notes"])
        return {"kind": "dense", "num_documents": self.num_documents, "encoder": m["encoder"]["model_id"],
                "faiss_type": m["faiss_type"], "extra": extra}


class BM25Retriever(Retriever):
    """A bm25s index queried with the tokenizer vocabulary it was built with."""

    kind = "bm25"

    def __init__(self, index_dir: str | Path, docstore: DocStore, *, n_threads: int = 0, mmap: bool = False):
        bm25s = import_bm25s()

        super().__init__(docstore)
        self.path = Path(index_dir)
        meta = read_meta(self.path)
        if meta is None or meta.get("kind") != "bm25":
            raise FailedPrecondition(f"{self.path} holds no finished BM25 index (no meta.json); run `prorag index`")
        _check_same_corpus(meta, docstore, self.path)
        self.meta = meta
        self.model = bm25s.BM25.load(str(self.path), mmap=mmap, load_vocab=True, show_progress=False)
        self.tokenizer = make_bm25_tokenizer(meta["config"]["stopwords"], meta["config"]["stemmer"])
        self.tokenizer.load_vocab(str(self.path))
        self.tokenizer.load_stopwords(str(self.path))
        self.n_threads = n_threads

    def search_raw(self, queries: list[str], k: int) -> Hits:
        k = min(k, self.meta["n_docs"])
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        # bm25s threads only pay off for larger batches; small ones stay on the caller's thread.
        threads = self.n_threads or (min(os.cpu_count() or 1, 4) if len(queries) >= 16 else 0)
        rows, scores = self.model.retrieve(ids, k=k, show_progress=False, n_threads=threads)
        # Zero score = no query term in the document: an arbitrary row, not a hit.
        return [[(int(i), float(s)) for i, s in zip(r, sc) if s > 0] for r, sc in zip(rows, scores)]

    def info(self) -> dict:
        c = self.meta["config"]
        return {"kind": "bm25", "num_documents": self.num_documents, "encoder": "", "faiss_type": "",
                "extra": {"k1": str(c["k1"]), "b": str(c["b"]), "method": c["method"], "path": str(self.path)}}


class HybridRetriever(Retriever):
    """Fuses a dense and a sparse retriever's candidate lists per query.

    ``rrf``: sum of 1/(rrf_k + rank) over the lists (scale-free, the default).
    ``weighted``: alpha * minmax(dense) + (1 - alpha) * minmax(sparse), per query.
    """

    kind = "hybrid"

    def __init__(self, dense: Retriever, sparse: Retriever, method: str = "rrf", rrf_k: int = 60,
                 candidate_k: int = 100, alpha: float = 0.5):
        if method not in ("rrf", "weighted"):
            raise InvalidArgument(f"hybrid method must be 'rrf' or 'weighted', got {method!r}")
        if rrf_k < 0 or candidate_k < 1 or not 0.0 <= alpha <= 1.0:
            raise InvalidArgument("hybrid needs rrf_k >= 0, candidate_k >= 1 and 0 <= alpha <= 1")
        if dense.num_documents != sparse.num_documents:
            raise FailedPrecondition("hybrid parts index different corpora (document counts differ)")
        super().__init__(dense.docstore)
        self.dense, self.sparse = dense, sparse
        self.method, self.rrf_k, self.candidate_k, self.alpha = method, rrf_k, candidate_k, alpha

    def search_raw(self, queries: list[str], k: int) -> Hits:
        ck = max(self.candidate_k, k)
        dense, sparse = self.dense.search_raw(queries, ck), self.sparse.search_raw(queries, ck)
        return [self._fuse(d, s)[:k] for d, s in zip(dense, sparse)]

    def _fuse(self, dense: list[tuple[int, float]], sparse: list[tuple[int, float]]) -> list[tuple[int, float]]:
        fused: dict[int, float] = {}
        for hits, weight in ((dense, self.alpha), (sparse, 1.0 - self.alpha)):
            if not hits:
                continue
            if self.method == "rrf":
                for rank, (i, _) in enumerate(hits, 1):
                    fused[i] = fused.get(i, 0.0) + 1.0 / (self.rrf_k + rank)
            else:
                s = np.array([x for _, x in hits], dtype=np.float64)
                span = s.max() - s.min()
                norm = (s - s.min()) / span if span > 0 else np.ones_like(s)
                for (i, _), v in zip(hits, norm):
                    fused[i] = fused.get(i, 0.0) + weight * float(v)
        return sorted(fused.items(), key=lambda t: (-t[1], t[0]))

    def info(self) -> dict:
        d = self.dense.info()
        extra = {"method": self.method, "candidate_k": str(self.candidate_k)}
        extra.update({"rrf_k": str(self.rrf_k)} if self.method == "rrf" else {"alpha": str(self.alpha)})
        return {"kind": "hybrid", "num_documents": self.num_documents, "encoder": d["encoder"],
                "faiss_type": d["faiss_type"], "extra": extra}


class PyseriniBM25Retriever(Retriever):
    """BM25 over an existing Lucene index (e.g. a prebuilt wiki-18 one) through pyserini.

    Rows are mapped to the doc store by id when one is given; without a store the
    documents come from the Lucene index's stored raw JSON.
    """

    kind = "bm25-lucene"

    def __init__(self, index_dir: str | Path, docstore: DocStore | None = None, *, k1: float = 0.9, b: float = 0.4,
                 threads: int = 1):
        try:
            from pyserini.search.lucene import LuceneSearcher
        except Exception as e:  # ImportError, or the JVM failing to start inside pyserini's import
            raise FailedPrecondition(
                f"the Lucene BM25 index needs pyserini and a JDK 21: pip install 'prorag[pyserini]' and put "
                f"a JDK 21 on PATH/JAVA_HOME ({type(e).__name__}: {e})") from None
        super().__init__(docstore)
        self.path = Path(index_dir)
        if not self.path.is_dir():
            raise FailedPrecondition(f"Lucene index {self.path} does not exist")
        self.searcher = LuceneSearcher(str(self.path))
        self.searcher.set_bm25(k1, b)
        self.threads = threads
        self._n = self.searcher.num_docs

    @property
    def num_documents(self) -> int:
        return self._n

    def _lucene(self, queries: list[str], k: int):
        qids = [str(i) for i in range(len(queries))]
        res = self.searcher.batch_search(list(queries), qids, k=k, threads=self.threads)
        return [res.get(q, []) for q in qids]

    def search_raw(self, queries: list[str], k: int) -> Hits:
        if self.docstore is None:
            raise FailedPrecondition("mapping Lucene hits to rows needs a doc store over the same corpus")
        try:
            return [[(self.docstore.index_of(h.docid), float(h.score)) for h in hits]
                    for hits in self._lucene(queries, k)]
        except NotFound as e:
            raise FailedPrecondition(f"Lucene index {self.path} and the doc store disagree: {e}") from None

    def search(self, queries: list[str], topk: int) -> list[list[Document]]:
        if self.docstore is not None:
            return super().search(queries, topk)

        out = []
        for hits in self._lucene(queries, topk):
            docs = []
            for rank, h in enumerate(hits, 1):
                d = Document.from_row(json.loads(self.searcher.doc(h.docid).raw()), f"{self.path}:{h.docid}")
                docs.append(dataclasses.replace(d, score=float(h.score), rank=rank))
            out.append(docs)
        return out


class RetrievalEngine:
    """Named retrievers over one doc store."""

    def __init__(self, indexes: dict[str, Retriever], docstore: DocStore, default: str = "hybrid"):
        if not indexes:
            raise FailedPrecondition("no index to serve; build some with `prorag index`")
        if default not in indexes:
            raise FailedPrecondition(f"default index {default!r} is not built (have: {', '.join(indexes)}); "
                                     "pick one of those as the default")
        self.indexes = dict(indexes)
        self.docstore = docstore
        self.default = default

    def search(self, queries: list[str], topk: int, index_name: str = "") -> list[list[Document]]:
        """Top ``topk`` documents per query from ``index_name`` ('' = the default), best first, in request order
        (fewer when the corpus is smaller)."""
        return self.indexes[index_name or self.default].search(list(queries), int(topk))

    def list_indexes(self) -> list[dict]:
        return [{"name": name, **r.info(), "is_default": name == self.default} for name, r in self.indexes.items()]

    def get_documents(self, ids: list[str]) -> list[Document]:
        """Documents by id, in the order asked; NotFound names every unknown id (up to 10)."""
        rows, missing = [], []
        for doc_id in ids:
            try:
                rows.append(self.docstore.index_of(str(doc_id)))
            except NotFound:
                missing.append(str(doc_id))
        if missing:
            shown = ", ".join(repr(m) for m in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise NotFound(f"{len(missing)} unknown document id(s): {shown}")
        return [self.docstore.get(r) for r in rows]

    def close(self) -> None:
        self.docstore.close()

    @classmethod
    def from_dir(cls, index_root: str | Path, default: str = "hybrid", *, device: str = "auto", use_gpu: str = "auto",
                 nprobe: int | None = None, ef_search: int | None = None, hybrid_method: str = "rrf", rrf_k: int = 60,
                 candidate_k: int = 100, alpha: float = 0.5, bm25_threads: int = 0, bm25_mmap: bool = False,
                 corpus_path: str | Path | None = None, lucene_index: str | Path | None = None,
                 encoder: Encoder | None = None, faiss_threads: int = 0) -> "RetrievalEngine":
        """Open what ``build_all`` wrote: ``docstore/`` and every index directory whose meta.json names a kind in
        :data:`INDEX_KINDS` (``dense/`` and its ``dense-*/`` variants, ``bm25/``), each served under its
        directory's name.

        "hybrid" is composed from "dense" (else the first dense variant) and "bm25" when both exist;
        ``lucene_index`` adds a pyserini "bm25-lucene" index. ``encoder`` is reused by every dense
        index built with the same encoder settings (tests, or one process serving variants).
        """
        root = Path(index_root)
        if not (root / "docstore" / "meta.json").is_file():
            raise FailedPrecondition(f"{root} has no finished doc store (docstore/meta.json); run `prorag index`")
        opening = IndexOpening(DocStore(root / "docstore", corpus_path=corpus_path), device=device, use_gpu=use_gpu,
                               nprobe=nprobe, ef_search=ef_search, faiss_threads=faiss_threads,
                               bm25_threads=bm25_threads, bm25_mmap=bm25_mmap)
        if encoder is not None:
            opening.encoders[repr(sorted(encoder.cfg.identity().items()))] = encoder
        indexes: dict[str, Retriever] = {}
        for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "docstore"):
            meta = read_meta(d)
            if meta is None:
                log.warning("skipping %s: no finished index there (no meta.json: an interrupted build?)", d)
                continue
            open_kind = INDEX_KINDS.get(meta.get("kind", ""))
            if open_kind is None:
                log.warning("skipping %s: index kind %r is not one this server opens (%s)", d, meta.get("kind"),
                            ", ".join(INDEX_KINDS))
                continue
            indexes[d.name] = open_kind(d, opening)
        dense_names = [n for n, r in indexes.items() if r.kind == "dense"]
        if dense_names and "bm25" in indexes:
            main = "dense" if "dense" in indexes else dense_names[0]
            indexes["hybrid"] = HybridRetriever(indexes[main], indexes["bm25"], method=hybrid_method, rrf_k=rrf_k,
                                                candidate_k=candidate_k, alpha=alpha)
        if lucene_index is not None:
            indexes["bm25-lucene"] = PyseriniBM25Retriever(lucene_index, opening.docstore)
        return cls(indexes, opening.docstore, default)


@dataclasses.dataclass
class IndexOpening:
    """What opening one index directory may read: the shared doc store, the server's index settings, and the
    query encoders already loaded (keyed by encoder identity), so dense variants built alike share one."""

    docstore: DocStore
    device: str = "auto"
    use_gpu: str = "auto"
    nprobe: int | None = None
    ef_search: int | None = None
    faiss_threads: int = 0
    bm25_threads: int = 0
    bm25_mmap: bool = False
    encoders: dict[str, Encoder] = dataclasses.field(default_factory=dict)


def open_dense(index_dir: Path, opening: IndexOpening) -> Retriever:
    key = repr(sorted(_encoder_cfg(read_meta(index_dir), opening.device).identity().items()))
    retriever = DenseRetriever(index_dir, opening.docstore, encoder=opening.encoders.get(key), device=opening.device,
                               use_gpu=opening.use_gpu, nprobe=opening.nprobe, ef_search=opening.ef_search,
                               faiss_threads=opening.faiss_threads)
    opening.encoders[key] = retriever.encoder
    return retriever


def open_bm25(index_dir: Path, opening: IndexOpening) -> Retriever:
    return BM25Retriever(index_dir, opening.docstore, n_threads=opening.bm25_threads, mmap=opening.bm25_mmap)


#: an index directory's kind (the "kind" of its meta.json, written by services.retriever.indexing) -> how to open
#: it: a new kind of index is one retriever class, one opener and one row here
INDEX_KINDS: dict[str, Callable[[Path, IndexOpening], Retriever]] = {
    "dense": open_dense,
    "bm25": open_bm25,
}
