"""Published policy models: immutable ``data/models/<world>/<name>/<version>/`` with a manifest.

A stage that fine-tunes the whole model (SFT, as ProRAG does) publishes it here; the policy
service serves a published model as its base, and LoRA adapters trained later load on top.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
from pathlib import Path

from prorag import paths
from prorag.errors import AlreadyExists, NotFound
from prorag.io import atomic_dir

MANIFEST = "published.json"


def model_dir(world: str, name: str, version: str) -> Path:
    return paths.data_dir() / "models" / world / name / version


def publish_model(src: str | Path, world: str, name: str, version: str, *, base_model: str = "",
                  extra: dict | None = None) -> Path:
    """Copy a saved HF model dir into the registry atomically; identical re-publish is a no-op."""
    from prorag.modeling import model_sha256

    src = Path(src)
    digest = model_sha256(src)
    dest = model_dir(world, name, version)
    if dest.exists():
        existing = json.loads((dest / MANIFEST).read_text())
        if existing.get("sha256") == digest:
            return dest
        raise AlreadyExists(f"model {name}@{version} already published with different weights")
    with atomic_dir(dest) as tmp:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        manifest = {"name": name, "version": version, "world": world, "sha256": digest, "base_model": base_model,
                    "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **(extra or {})}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return dest


def resolve_model(world: str, spec: str) -> Path:
    """``name@version``, ``name`` (newest version) or a path -> the model directory."""
    p = Path(spec)
    if p.is_dir():
        return p
    name, _, version = spec.partition("@")
    root = paths.data_dir() / "models" / world / name
    if version:
        d = root / version
        if not (d / MANIFEST).exists():
            raise NotFound(f"model {spec} is not published under {root}")
        return d
    versions = sorted((d for d in root.glob("*") if (d / MANIFEST).exists()),
                      key=lambda d: json.loads((d / MANIFEST).read_text())["created_at"]) if root.exists() else []
    if not versions:
        raise NotFound(f"no published versions of model {name!r} under {root}")
    return versions[-1]


def trained_topk(model: str | Path) -> int | None:
    """Documents per search the published model was trained with (None when its manifest does not say:
    a path that is no published model, or one published before the field existed)."""
    manifest = Path(model) / MANIFEST
    if not manifest.exists():
        return None
    topk = json.loads(manifest.read_text()).get("topk")
    return int(topk) if topk else None
