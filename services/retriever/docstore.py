"""Reading what the index build wrote: each artifact's ``meta.json`` and the doc store.

Search needs only this module (and the encoders), never the builder in :mod:`services.retriever.indexing`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from prorag.data.loaders import Document
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound


def read_meta(index_dir: str | Path) -> dict | None:
    """``index_dir/meta.json``, or None while the directory holds no finished artifact."""
    return read_json(Path(index_dir) / "meta.json")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parse_row(raw: bytes, where: str) -> Document:
    """One corpus line as a document; ``where`` names it in the error."""
    try:
        row = json.loads(raw)
    except ValueError as e:
        raise InvalidArgument(f"{where}: not valid JSON ({e})") from None
    return Document.from_row(row, where)


class DocStore:
    """Random access to corpus rows by row index or id, without loading the corpus.

    Offsets and ids are memory-mapped numpy arrays; a lookup by id is a binary search
    over the sorted ids; a document read is one ``os.pread`` (thread-safe, no shared
    file position).
    """

    def __init__(self, path: str | Path, corpus_path: str | Path | None = None):
        self.path = Path(path)
        meta = read_meta(self.path)
        if meta is None or meta.get("kind") != "docstore":
            raise FailedPrecondition(f"{self.path} is not a finished doc store (no meta.json); run `prorag index`")
        self.meta = meta
        self.corpus_path = Path(corpus_path) if corpus_path else _recorded_corpus(self.path, meta)
        if not self.corpus_path.is_file():
            raise FailedPrecondition(
                f"doc store {self.path} reads its corpus {self.corpus_path}, which is missing; "
                "restore it or pass corpus_path")
        size = self.corpus_path.stat().st_size
        if size != meta["corpus_size"]:
            raise FailedPrecondition(
                f"corpus {self.corpus_path} changed since the doc store was built "
                f"({size} bytes, built from {meta['corpus_size']}); rebuild with `prorag index`")
        self.offsets = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.ids = np.load(self.path / "ids.npy", mmap_mode="r")
        self._ids_sorted = np.load(self.path / "ids_sorted.npy", mmap_mode="r")
        self._ids_order = np.load(self.path / "ids_order.npy", mmap_mode="r")
        self._size = size
        self._fd = os.open(self.corpus_path, os.O_RDONLY)

    @property
    def corpus_sha256(self) -> str:
        return self.meta["corpus_sha256"]

    def __len__(self) -> int:
        return len(self.offsets)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def get(self, idx: int) -> Document:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise NotFound(f"document row {idx} is out of range (the store holds {len(self)} documents)")
        start = int(self.offsets[idx])
        end = int(self.offsets[idx + 1]) if idx + 1 < len(self) else self._size
        return parse_row(os.pread(self._fd, end - start, start), f"{self.corpus_path} row {idx}")

    def index_of(self, doc_id: str) -> int:
        """Row index of ``doc_id``; NotFound when the corpus has no such id."""
        key = str(doc_id).encode()
        if len(key) > self._ids_sorted.dtype.itemsize:
            raise NotFound(f"unknown document id {doc_id!r}")
        pos = int(np.searchsorted(self._ids_sorted, key))
        if pos >= len(self._ids_sorted) or self._ids_sorted[pos] != key:
            raise NotFound(f"unknown document id {doc_id!r}")
        return int(self._ids_order[pos])

    def get_by_id(self, doc_id: str) -> Document:
        return self.get(self.index_of(doc_id))


def _recorded_corpus(docstore_dir: Path, meta: dict) -> Path:
    """The corpus a doc store reads: the absolute path it recorded, else (that path gone, e.g. the volume is mounted
    elsewhere now) the same file relative to the doc store, as recorded next to it."""
    recorded = Path(meta["corpus_path"])
    rel = meta.get("corpus_relpath")
    if not recorded.is_file() and rel and (docstore_dir / rel).is_file():
        return (docstore_dir / rel).resolve()
    return recorded
