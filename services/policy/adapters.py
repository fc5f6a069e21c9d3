"""Versioned LoRA adapters: immutable ``name@version`` directories with a manifest.

Layout under the adapter root: ``<root>/<name>/<version>/{adapter_config.json,
adapter_model.safetensors, manifest.json}``. A version, once published, never changes
(re-publishing identical bytes is a no-op, different bytes is refused), so a version
string names exactly one set of weights on every replica — the cure for vLLM's stale
cache after a same-name reload. Only safetensors are loaded (no pickles), only from
inside the root, and only for the base model they were trained on.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from prorag.io import atomic_dir, sha256_file

_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class AdapterRef:
    name: str
    version: str

    @classmethod
    def parse(cls, key: str) -> "AdapterRef":
        if "@" not in key:
            raise InvalidArgument(f"adapter {key!r} must be written name@version, e.g. policy@v3")
        name, version = key.split("@", 1)
        return cls.of(name, version)

    @classmethod
    def of(cls, name: str, version: str) -> "AdapterRef":
        for what, part in (("name", name), ("version", version)):
            if not _PART.match(part or ""):
                raise InvalidArgument(f"adapter {what} {part!r} must be 1-64 of [A-Za-z0-9._-], starting alphanumeric")
        return cls(name, version)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def __str__(self) -> str:
        return self.key


@dataclass
class Manifest:
    name: str
    version: str
    base_model: str
    base_model_sha256: str
    sha256: str
    rank: int = 0
    step: int = 0
    created_at: str = ""

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise FailedPrecondition(f"adapter manifest {path} is unreadable: {e}") from None


def _rank_of(adapter_dir: Path) -> int:
    try:
        return int(json.loads((adapter_dir / CONFIG).read_text()).get("r", 0))
    except (OSError, json.JSONDecodeError, ValueError):
        return 0


def publish(src_dir: str | Path, root: str | Path, ref: AdapterRef, *, base_model: str, base_model_sha256: str,
            step: int = 0) -> Manifest:
    """Copy a peft adapter dir into ``root/name/version`` atomically, with its manifest."""
    src, root = Path(src_dir), Path(root)
    for f in (CONFIG, WEIGHTS):
        if not (src / f).exists():
            raise FailedPrecondition(f"{src} has no {f}; save the adapter with safe_serialization (safetensors)")
    digest = sha256_file(src / WEIGHTS)
    dest = root / ref.name / ref.version
    if dest.exists():
        existing = Manifest.read(dest / MANIFEST)
        if existing.sha256 == digest and existing.base_model_sha256 == base_model_sha256:
            return existing
        raise AlreadyExists(f"adapter {ref} already exists with different weights; versions are immutable, "
                            f"publish a new version instead")
    manifest = Manifest(ref.name, ref.version, base_model, base_model_sha256, digest, _rank_of(src), step,
                        _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    with atomic_dir(dest) as tmp:
        shutil.copy2(src / CONFIG, tmp / CONFIG)
        shutil.copy2(src / WEIGHTS, tmp / WEIGHTS)
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    return manifest


def verify(root: str | Path, ref: AdapterRef, path: str = "", *, base_model_sha256: str) -> tuple[Path, Manifest]:
    """Check an adapter before it is loaded; every refusal says what is wrong and how to fix it."""
    root = Path(root).resolve()
    candidate = (root / path) if path else (root / ref.name / ref.version)
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise InvalidArgument(f"adapter path {path!r} resolves outside the adapter root {root}; "
                              f"adapters load only from inside it")
    if not resolved.is_dir():
        raise NotFound(f"adapter {ref} not found at {resolved}; publish it under {root}/{ref.name}/{ref.version}")
    pickles = sorted(p.name for p in resolved.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
    if pickles:
        raise FailedPrecondition(f"adapter {ref} contains pickled weights {pickles}; only safetensors are loaded")
    for f in (CONFIG, WEIGHTS, MANIFEST):
        if not (resolved / f).is_file():
            raise FailedPrecondition(f"adapter {ref} at {resolved} has no {f}")
    manifest = Manifest.read(resolved / MANIFEST)
    if (manifest.name, manifest.version) != (ref.name, ref.version):
        raise InvalidArgument(f"manifest at {resolved} is for {manifest.name}@{manifest.version}, not {ref}")
    actual = sha256_file(resolved / WEIGHTS)
    if actual != manifest.sha256:
        raise FailedPrecondition(f"adapter {ref} is corrupt: sha256 of {WEIGHTS} is {actual[:12]}..., "
                                 f"manifest says {manifest.sha256[:12]}...")
    if manifest.base_model_sha256 != base_model_sha256:
        raise FailedPrecondition(f"adapter {ref} was trained on base model {manifest.base_model} "
                                 f"({manifest.base_model_sha256[:12]}...), but this server runs "
                                 f"{base_model_sha256[:12]}...")
    try:
        from safetensors import safe_open

        with safe_open(str(resolved / WEIGHTS), framework="pt") as fh:
            list(fh.keys())
    except Exception as e:  # noqa: BLE001 - any parse failure means unusable weights
        raise FailedPrecondition(f"adapter {ref}: {WEIGHTS} is not a readable safetensors file ({e})") from None
    return resolved, manifest


def list_published(root: str | Path) -> list[AdapterRef]:
    root = Path(root)
    if not root.exists():
        return []
    out = []
    for name_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for ver in sorted(p for p in name_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (ver / MANIFEST).exists():
                out.append(AdapterRef(name_dir.name, ver.name))
    return out
