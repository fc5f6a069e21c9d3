"""Atomic file writes and small JSONL helpers: no half-written artifact is ever visible."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are read by other users/containers
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # some filesystems (network, FUSE) cannot fsync a directory: nothing more durable is possible there
        if not directory or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` too), so a rename of ``root`` publishes
    contents that are on disk, not only in the page cache."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = Path(dirpath, name)
            if not p.is_symlink():
                _fsync_path(p)
        _fsync_path(Path(dirpath), directory=True)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the libc or the
    filesystem cannot, and the caller falls back to two renames."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def recover_dir(path: str | Path) -> None:
    """Repair what a process that died inside :func:`atomic_dir`'s two-rename fallback left: the old copy
    renamed aside with nothing at ``path`` (put it back), or both (drop the aside copy). Readers that
    may run right after such a crash call this before opening ``path``; atomic_dir calls it itself."""
    path = Path(path)
    aside = _aside(path)
    if not aside.exists():
        return
    if path.exists():
        # the new copy got in; the aside one is the old copy (maybe half deleted)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        # died between the renames: the aside copy is the complete old one (only ever removed
        # while ``path`` exists)
        os.replace(aside, path)
        _fsync_path(path.parent, directory=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it becomes ``path`` (replacing an old one).

    Durable and never missing: the new tree is fsynced before it is renamed in, the parent after. An
    existing ``path`` is swapped with the new tree in one atomic exchange where the filesystem can
    (Linux renameat2); elsewhere the old copy is renamed aside first, and a death between the two
    renames is repaired by :func:`recover_dir` (run by the next atomic_dir call on ``path``). Two
    writers of the same ``path`` at once are not supported (callers hold their own lock)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)
    try:
        yield tmp
        fsync_tree(tmp)
        if not path.exists():
            os.replace(tmp, path)
        elif _exchange(tmp, path):
            pass  # ``tmp`` now holds the old copy; the finally below removes it
        else:
            aside = _aside(path)
            os.replace(path, aside)
            try:
                os.replace(tmp, path)
            except BaseException:
                # put the old copy back so ``path`` stays readable; if this fails too, recover_dir will
                with contextlib.suppress(OSError):
                    os.replace(aside, path)
                raise
            _fsync_path(path.parent, directory=True)
            shutil.rmtree(aside, ignore_errors=True)
        _fsync_path(path.parent, directory=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def append_jsonl_synced(path: str | Path, row: dict) -> None:
    """Append ``row`` as one JSON line and fsync it: a journal or cache that a killed process keeps up to its
    last whole row."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl_journal(path: str | Path) -> Iterator[dict]:
    """The rows of an append-only JSONL journal (none when the file is absent), skipping any line a kill tore:
    what that line held is redone by whoever wrote it."""
    path = Path(path)
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
