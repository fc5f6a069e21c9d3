"""Training checkpoints: atomic, self-describing, last K kept.

A checkpoint is one ``torch.save`` file ``step-<N>.pt`` holding whatever the stage
passes (model / optimizer / scheduler state dicts, data position) plus the RNG states
of torch, numpy and Python's ``random``. It is written to a temporary sibling,
fsynced and renamed into place, so a crash at any moment leaves either the previous
checkpoint set or the new one, never a truncated file under a real name.

A launch on several processes (services/trainer/launch.py) checkpoints differently, because each process holds
part of the state (its RNG states; under FSDP its shard of the weights and optimizer): a directory ``step-<N>/``
written by accelerate's ``save_state`` on every process into a temporary sibling that the main process renames
once all are done (:func:`save_launch`, :func:`load_latest_launch`). The two kinds are never mixed in one
directory: resuming one kind from the other is refused rather than silently starting over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prorag.errors import FailedPrecondition
from prorag.io import atomic_dir, atomic_path
from prorag.training.distributed import from_main

log = logging.getLogger("prorag.trainer.checkpoint")

_NAME = re.compile(r"^step-(\d{9})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def capture_rng() -> dict:
    """RNG states of torch, numpy and random as plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        # random's state is a tuple of ints; a list survives the weights_only loader
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first; temp files are not listed."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _fsync_dir(d: Path) -> None:
    # The rename is only durable once the directory entry is on disk.
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(ckpt_dir: str | Path, state: dict, step: int, keep: int = 2, include_rng: bool = True) -> Path:
    """Write ``state`` as the checkpoint for ``step`` atomically, then drop all but the last ``keep``."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    payload = dict(state)
    payload["step"] = int(step)
    if include_rng:
        payload["rng"] = capture_rng()
    path = d / checkpoint_name(step)
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    _fsync_dir(d)
    for _, old in list_checkpoints(d)[:-keep]:
        try:
            old.unlink()
        except FileNotFoundError:
            pass
    return path


class UnsafeFile(FailedPrecondition):
    """A torch file that would run code to load (a pickled object other than tensors and plain values)."""


def load_weights_file(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` of a file a caller or a shared volume could have written: tensors and plain values only
    (weights_only), never code. Anything else -> :class:`UnsafeFile` naming the file and what it asked for,
    instead of torch's message, which suggests retrying with weights_only=False."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # A global or an object to build is code to run; any other refusal (a bad opcode) is a damaged file.
        what = next((ln for ln in lines if "GLOBAL" in ln or ln.startswith(("Can only create", "Can only build"))),
                    None)
        if what is None:
            raise
        raise UnsafeFile(f"refusing to load {path}: it holds a pickled object that is not plain data ({what}); "
                         f"only tensors, numbers, strings, lists and dicts are loaded, because loading anything "
                         f"else runs code the file names. Re-save it as plain data (e.g. a state_dict), or delete "
                         f"it if it did not come from this program") from None


def load(path: str | Path) -> dict:
    # weights_only: a checkpoint is data; it never needs to run code to load.
    return load_weights_file(path)


def load_latest(ckpt_dir: str | Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads; an unreadable one is skipped with a warning. One that would run code
    (:class:`UnsafeFile`) is not skipped: it was written by something other than this program, and resuming
    from an older checkpoint would hide that."""
    if not list_checkpoints(ckpt_dir) and list_launch_checkpoints(ckpt_dir):
        # starting over would silently drop the launch's progress
        raise FailedPrecondition(f"{ckpt_dir} holds checkpoints of a launch on several processes (step-N/), not of "
                                 "a single-process run; resume it with the same launch (torchrun / accelerate "
                                 "launch), or start in a new work directory")
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return load(path), path
        except UnsafeFile:
            raise
        except Exception as exc:  # noqa: BLE001 - fall back to the previous checkpoint
            log.warning("checkpoint %s (step %d) is unreadable, trying an older one: %s", path, step, exc)
    return None


def cleanup_temp(ckpt_dir: str | Path) -> int:
    """Remove temp files (and the temp directories of a launch's checkpoints) a killed writer left behind; returns
    how many."""
    d = Path(ckpt_dir)
    n = 0
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                n += 1
    return n


# ---------------------------------------------------------------- checkpoints of a launch on several processes
#: a launch's checkpoint is a directory step-<N>/: accelerate's save_state (the model and optimizer, gathered or
#: per process as its engine saves them, and every process's RNG states) plus LOOP_STATE, written last
_DIR = re.compile(r"^step-(\d{9})$")
LOOP_STATE = "loop.pt"


def list_launch_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint directory of a launch, oldest first (temp directories and a
    directory without its LOOP_STATE are not listed)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _DIR.match(p.name)
        if m and p.is_dir() and (p / LOOP_STATE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_launch(ckpt_dir: str | Path, accelerator, state: dict, step: int, keep: int = 2) -> Path:
    """Every process of a launch calls this at the same step: accelerate's ``save_state`` (each process writes its
    part: under FSDP its shard of the model and optimizer, and its RNG states) into a temp directory, which the
    main process renames to ``step-<N>`` once every process is done (``state``, the loop's own part, e.g. the
    scheduler, written last as LOOP_STATE); then all but the last ``keep`` are dropped. A kill at any moment
    leaves the previous checkpoints complete and at most a temp directory, which the next resume removes."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    d = Path(ckpt_dir)
    final = d / f"step-{step:09d}"
    with contextlib.ExitStack() as stack:
        tmp = None
        if accelerator.is_main_process:
            d.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(atomic_dir(final))  # fsynced and renamed in when the block ends
        tmp = Path(from_main(accelerator, lambda: str(tmp)))
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()  # every process's files are written before the rename
        if accelerator.is_main_process:
            torch.save({**state, "step": int(step), "processes": accelerator.num_processes}, tmp / LOOP_STATE)
    if accelerator.is_main_process:
        _fsync_dir(d)

        for _, old in list_launch_checkpoints(d)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()  # no process goes on (or exits) before the checkpoint is in place
    return final


def load_latest_launch(ckpt_dir: str | Path, accelerator) -> tuple[dict, Path] | None:
    """Every process of a launch calls this: the newest complete checkpoint (the main process picks it, so all
    load the same one) restored through accelerate's ``load_state`` (model, optimizer, this process's RNG
    states); returns (its LOOP_STATE, path), or None on a fresh start. The main process first removes the temp
    directories a killed launch left."""
    def pick() -> str | None:
        cleanup_temp(ckpt_dir)
        found = list_launch_checkpoints(ckpt_dir)
        if not found and list_checkpoints(ckpt_dir):
            raise FailedPrecondition(f"{ckpt_dir} holds checkpoints of a single-process run (step-N.pt), not of a "
                                     "launch on several processes; resume it on one process, or start the launch "
                                     "in a new work directory")
        return str(found[-1][1]) if found else None

    path = from_main(accelerator, pick)
    if path is None:
        return None
    accelerator.load_state(path)
    return load(Path(path) / LOOP_STATE), Path(path)


def state_to_device(obj: Any, device: str | torch.device) -> Any:
    """Move every tensor in a nested state to ``device`` (checkpoints load on CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: state_to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_to_device(v, device) for v in obj)
    return obj
