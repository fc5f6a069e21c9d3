"""Results reused between runs: an evaluation or a PRM validation already computed by the same committed code on
the same weights, questions and settings is read back instead of recomputed.

Why: `prorag run --profile ablation` is seven runs over one SFT agent and PRM, and every run evaluated the same
SFT agent, baselines and PRM again (about 10 of each run's 15 minutes on 2 cores). Greedy evaluation and the PRM
validation are deterministic functions of their inputs, so a result is keyed by everything it depends on: the code
(the committed trees of the code directories; uncommitted code or no git never reuses), the weights' hashes,
the world's corpus, the questions and the settings. Entries live under ``<runs>/cache/<kind>/<key>/`` (one JSON
result and the files it wrote), each written by one atomic rename, so a killed run never leaves half an entry.
The store is bounded: past ``PRORAG_CACHE_MAX_BYTES`` (default 2 GiB) the least recently used entries go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from prorag import paths
from prorag.io import atomic_dir, sha256_file, write_json

RESULT = "result.json"
log = logging.getLogger("prorag.memo")


def fingerprint(obj: Any) -> str:
    """sha256 of ``obj`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def questions_fingerprint(questions: Sequence) -> str:
    """Identity of a question list: ids, texts and gold answers, in order."""
    return fingerprint([(q.id, q.question, list(q.golden_answers)) for q in questions])


def corpus_fingerprint(world: str) -> str:
    """sha256 of the world's corpus file ('' when the world has none, e.g. an external corpus)."""
    corpus = paths.world_dir(world) / "corpus.jsonl"
    return sha256_file(corpus) if corpus.is_file() else ""


#: the directories whose code computes results; a commit that changes only docs or tests keeps the cache
CODE_DIRS = ("prorag", "services", "prorag_app", "protos")


def code_identity() -> str:
    """The committed trees of :data:`CODE_DIRS` (git tree hashes); "" when git cannot say or any of them has
    uncommitted changes (then nothing is reused)."""
    root = Path(__file__).resolve().parent.parent
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS],
                               capture_output=True, text=True, timeout=10, cwd=root)
        trees = subprocess.run(["git", "rev-parse", *(f"HEAD:{d}" for d in CODE_DIRS)],
                               capture_output=True, text=True, timeout=10, cwd=root)
    except (OSError, subprocess.SubprocessError):
        return ""
    if dirty.returncode or trees.returncode or dirty.stdout.strip():
        return ""
    return fingerprint(trees.stdout.split())


def memo_key(kind: str, parts: Mapping[str, Any], code: str | None = None) -> str | None:
    """The key of a ``kind`` result computed from ``parts`` by ``code`` (default: :func:`code_identity`); None
    (never reuse) when the code is not committed."""
    code = code_identity() if code is None else code
    if not code:
        return None
    return f"{kind}-{fingerprint({'code': code, **parts})[:20]}"


#: the store's size bound when PRORAG_CACHE_MAX_BYTES does not say (a full ablation report keeps ~130 MB)
DEFAULT_MAX_BYTES = 2 << 30


def _root() -> Path:
    return paths.runs_dir() / "cache"


def _entry(kind: str, key: str) -> Path:
    return _root() / kind / key


def max_bytes() -> int:
    raw = os.environ.get("PRORAG_CACHE_MAX_BYTES", "")
    try:
        limit = int(raw) if raw else DEFAULT_MAX_BYTES
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"PRORAG_CACHE_MAX_BYTES={raw!r} is not a number of bytes (>= 0)")
    return limit


def prune(limit: int | None = None) -> list[Path]:
    """Delete the least recently used entries (by their result's mtime, which a load refreshes) until the store
    holds at most ``limit`` bytes (default :func:`max_bytes`); returns the deleted entries."""
    limit = max_bytes() if limit is None else limit
    entries = []
    for result in _root().glob(f"*/*/{RESULT}"):
        try:
            used = result.stat().st_mtime
            size = sum(f.stat().st_size for f in result.parent.iterdir() if f.is_file())
        except OSError:  # removed meanwhile by another run's prune
            continue
        entries.append((used, size, result.parent))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
        removed.append(entry)
    return removed


def load(kind: str, key: str | None, into: Path | None = None) -> dict | None:
    """The stored result of ``key`` (its files copied into ``into`` when given), or None."""
    if key is None:
        return None
    entry = _entry(kind, key)
    result = entry / RESULT
    if not result.is_file():
        return None
    try:
        value = json.loads(result.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: computed again, and the store below replaces it
    try:
        os.utime(result)  # recently used: the last to be pruned
    except OSError:
        pass
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
        for f in entry.iterdir():
            if f.name != RESULT and f.is_file():
                shutil.copy2(f, into / f.name)
    return value


def store(kind: str, key: str | None, result: dict, files: Sequence[Path] = ()) -> None:
    """Keep ``result`` (and copies of ``files``) under ``key``; a None key keeps nothing."""
    if key is None:
        return
    with atomic_dir(_entry(kind, key)) as tmp:
        for f in map(Path, files):
            if f.is_file():  # e.g. no PNG where plotting is unavailable
                shutil.copy2(f, tmp / f.name)
        write_json(tmp / RESULT, result)
    try:
        prune()
    except ValueError as e:  # a mistyped bound must not fail the run whose result was just kept: say so, go on
        log.warning("runs/cache not pruned: %s", e)


__all__ = ["CODE_DIRS", "DEFAULT_MAX_BYTES", "code_identity", "corpus_fingerprint", "fingerprint", "load", "max_bytes",
           "memo_key", "prune", "questions_fingerprint", "store"]
