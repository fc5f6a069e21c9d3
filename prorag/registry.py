"""The one registry of published artifacts: full models, LoRA adapters and process reward models.

An artifact is an immutable directory ``<root>/<name>/<version>/`` holding its files and a
``manifest.json`` (kind, name, version, sha256 of its weights, the base model it was trained on
and that model's hash, the config that produced it, its metrics). Publishing copies the files
and writes the manifest into a temporary sibling that becomes the artifact in one rename, so a
reader sees all of it or nothing. A version, once published, never changes: re-publishing the
same weights is a no-op and different weights are refused, so ``name@version`` names exactly
one set of weights on every replica (the cure for vLLM's stale cache after a same-name reload).
Only safetensors are loaded (no pickles), only from inside the root, and an adapter only onto
the base model it was trained on.

Roots (:func:`registry`): models ``data/models/<world>``, adapters ``data/adapters/<world>``,
process reward models ``data/prms/<world>``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from prorag import paths
from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from prorag.io import atomic_dir, sha256_file

MANIFEST = "manifest.json"
#: files an artifact of each kind must hold besides its safetensors weights and the manifest
REQUIRED_FILES: dict[str, tuple[str, ...]] = {
    "model": ("config.json",),
    "adapter": ("adapter_config.json", "adapter_model.safetensors"),
    "prm": ("config.json",),
}
KINDS = tuple(REQUIRED_FILES)
_ROOT_DIRS = {"model": "models", "adapter": "adapters", "prm": "prms"}
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class ArtifactRef:
    """``name@version`` of a published artifact; both parts are safe single path components."""

    name: str
    version: str

    @classmethod
    def parse(cls, key: str) -> "ArtifactRef":
        if "@" not in key:
            raise InvalidArgument(f"{key!r} must be written name@version, e.g. policy@v3")
        name, version = key.split("@", 1)
        return cls.of(name, version)

    @classmethod
    def of(cls, name: str, version: str) -> "ArtifactRef":
        for what, part in (("name", name), ("version", version)):
            if not _PART.match(part or ""):
                raise InvalidArgument(f"{what} {part!r} must be 1-128 of [A-Za-z0-9._-], starting alphanumeric")
        return cls(name, version)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def __str__(self) -> str:
        return self.key


@dataclass
class Manifest:
    """What a published artifact records about itself (``manifest.json``)."""

    kind: str
    name: str
    version: str
    sha256: str                      # weights_sha256 of the artifact's directory
    base_model: str = ""             # what it was trained from (a path or name@version)
    base_model_sha256: str = ""      # weights_sha256 of that base; adapters load only onto it
    config: dict = field(default_factory=dict)   # the config of the job that produced it
    metrics: dict = field(default_factory=dict)  # its final metrics
    rank: int = 0                    # LoRA rank (adapters)
    step: int = 0                    # training step it was taken at
    created_at: str = ""

    @property
    def ref(self) -> ArtifactRef:
        return ArtifactRef(self.name, self.version)

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise FailedPrecondition(f"manifest {path} is unreadable: {e}") from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"


def weights_sha256(path: str | Path) -> str:
    """Identity of a model or adapter directory: sha256 over the names and hashes of its safetensors files.

    The one hash every artifact uses, and the base-model identity adapters and job ids refer to."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise NotFound(f"no .safetensors files under {path}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _check_files(d: Path, kind: str, what: str) -> None:
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in _PICKLES)
    if pickles:
        raise FailedPrecondition(f"{what} contains pickled weights {pickles}; only safetensors are loaded")
    missing = [f for f in REQUIRED_FILES[kind] if not (d / f).is_file()]
    if missing:
        raise FailedPrecondition(f"{what} at {d} has no {', '.join(missing)}")
    if not any(d.glob("*.safetensors")):
        raise FailedPrecondition(f"{what} at {d} has no .safetensors weights; save with safe_serialization")


def _lora_rank(d: Path) -> int:
    try:
        return int(json.loads((d / "adapter_config.json").read_text()).get("r", 0))
    except (OSError, json.JSONDecodeError, ValueError):
        return 0


class Registry:
    """Published artifacts of one kind under one root."""

    def __init__(self, root: str | Path, kind: str):
        if kind not in REQUIRED_FILES:
            raise InvalidArgument(f"unknown artifact kind {kind!r} (known: {', '.join(KINDS)})")
        self.root = Path(root)
        self.kind = kind

    def path(self, ref: ArtifactRef) -> Path:
        return self.root / ref.name / ref.version

    def publish(self, src: str | Path, ref: ArtifactRef, *, base_model: str = "", base_model_sha256: str = "",
                config: dict | None = None, metrics: dict | None = None, step: int = 0) -> Manifest:
        """Copy the files of ``src`` into ``<root>/<name>/<version>`` atomically, with the manifest.

        Idempotent for identical weights on the same base; different weights -> AlreadyExists."""
        src = Path(src)
        if not src.is_dir():
            raise NotFound(f"{self.kind} to publish: {src} is not a directory")
        _check_files(src, self.kind, f"{self.kind} {ref}")
        digest = weights_sha256(src)
        dest = self.path(ref)
        if dest.exists():
            existing = Manifest.read(dest / MANIFEST)
            if existing.sha256 == digest and existing.base_model_sha256 == base_model_sha256:
                return existing
            raise AlreadyExists(f"{self.kind} {ref} is already published with different weights; versions are "
                                f"immutable, publish a new version instead")
        manifest = Manifest(self.kind, ref.name, ref.version, digest, base_model, base_model_sha256,
                            dict(config or {}), dict(metrics or {}),
                            _lora_rank(src) if self.kind == "adapter" else 0, int(step),
                            _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        with atomic_dir(dest) as tmp:
            for f in src.iterdir():
                if f.is_file() and f.name != MANIFEST:
                    shutil.copy2(f, tmp / f.name)
            (tmp / MANIFEST).write_text(manifest.to_json())
        return manifest

    def verify(self, ref: ArtifactRef, path: str = "", *, base_model_sha256: str | None = None
               ) -> tuple[Path, Manifest]:
        """Check an artifact before it is loaded; every refusal says what is wrong and how to fix it.

        path: a directory relative to the root ('' = ``<name>/<version>``); it must stay inside the root.
        base_model_sha256: when given, the artifact must have been trained on exactly that base."""
        root = self.root.resolve()
        if "\x00" in path:
            raise InvalidArgument(f"{self.kind} path {path!r} contains a NUL character; give a directory relative to "
                                  f"the registry root {root}")
        if len(path) > 1024 or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in Path(path).parts):
            raise InvalidArgument(f"{self.kind} path {path[:60]!r}... is too long ({len(path):,} characters): at most "
                                  "1,024, and 255 bytes per directory name")
        resolved = ((root / path) if path else (root / ref.name / ref.version)).resolve()
        if not resolved.is_relative_to(root):
            raise InvalidArgument(f"{self.kind} path {path!r} resolves outside the registry root {root}; "
                                  f"artifacts load only from inside it")
        try:
            is_dir = resolved.is_dir()
        except OSError as e:  # e.g. a directory on the way that this process may not read
            raise FailedPrecondition(f"{self.kind} {ref}: cannot read {resolved}: {e.strerror}") from None
        if not is_dir:
            raise NotFound(f"{self.kind} {ref} not found at {resolved}; publish it under "
                           f"{root}/{ref.name}/{ref.version}")
        if not (resolved / MANIFEST).is_file():
            raise FailedPrecondition(f"{self.kind} {ref} at {resolved} has no {MANIFEST}")
        _check_files(resolved, self.kind, f"{self.kind} {ref}")
        manifest = Manifest.read(resolved / MANIFEST)
        if (manifest.name, manifest.version) != (ref.name, ref.version):
            raise InvalidArgument(f"manifest at {resolved} is for {manifest.name}@{manifest.version}, not {ref}")
        actual = weights_sha256(resolved)
        if actual != manifest.sha256:
            raise FailedPrecondition(f"{self.kind} {ref} is corrupt: its weights hash to {actual[:12]}..., "
                                     f"the manifest says {manifest.sha256[:12]}...")
        if base_model_sha256 is not None and manifest.base_model_sha256 != base_model_sha256:
            raise FailedPrecondition(f"{self.kind} {ref} was trained on base model {manifest.base_model} "
                                     f"({manifest.base_model_sha256[:12]}...), but this server runs "
                                     f"{base_model_sha256[:12]}...")
        try:
            from safetensors import safe_open

            for f in resolved.glob("*.safetensors"):
                with safe_open(str(f), framework="pt") as fh:
                    list(fh.keys())
        except Exception as e:  # noqa: BLE001 - any parse failure means unusable weights
            raise FailedPrecondition(f"{self.kind} {ref}: weights are not readable safetensors ({e})") from None
        return resolved, manifest

    def manifest(self, ref: ArtifactRef) -> Manifest:
        path = self.path(ref) / MANIFEST
        if not path.is_file():
            raise NotFound(f"{self.kind} {ref} is not published under {self.root}")
        return Manifest.read(path)

    def list(self) -> list[ArtifactRef]:
        """Every published ``name@version``, sorted by name, then version."""
        if not self.root.is_dir():
            return []
        return [ArtifactRef(n.name, v.name)
                for n in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
                for v in sorted(p for p in n.iterdir() if p.is_dir() and not p.name.startswith("."))
                if (v / MANIFEST).is_file()]

    def resolve(self, spec: str) -> Path:
        """``name@version``, ``name`` (its newest version) or an existing directory -> the directory."""
        p = Path(spec)
        if p.is_dir():
            return p
        if "/" in spec or spec.startswith("."):
            raise NotFound(f"{self.kind} directory {spec} does not exist")
        if "@" in spec:
            ref = ArtifactRef.parse(spec)
            self.manifest(ref)  # NotFound when it is not published
            return self.path(ref)
        ArtifactRef.of(spec, "v")  # the name must be a safe path part
        versions = [r for r in self.list() if r.name == spec]
        if not versions:
            raise NotFound(f"no published versions of {self.kind} {spec!r} under {self.root}")
        newest = max(versions, key=lambda r: (self.manifest(r).created_at, r.version))
        return self.path(newest)


def registry(kind: str, world: str) -> Registry:
    """The registry of ``kind`` ("model", "adapter", "prm") for an embedded world (or any data set name)."""
    if kind not in _ROOT_DIRS:
        raise InvalidArgument(f"unknown artifact kind {kind!r} (known: {', '.join(KINDS)})")
    return Registry(paths.data_dir() / _ROOT_DIRS[kind] / world, kind)


def artifact_name(path: str | Path, sha256: str = "") -> str:
    """How a served model is named to callers: its ``name@version`` when it is published, else its directory's
    name at the first 12 hex digits of its weights' hash (a version that changes whenever the weights do).
    sha256: that hash when the caller has it already (hashing an 8B model's shards takes a while)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return Manifest.read(path / MANIFEST).ref.key
    return f"{path.name}@{(sha256 or weights_sha256(path))[:12]}"


def published_config(path: str | Path) -> dict:
    """The config a published artifact was trained with; {} for a directory that was never published."""
    manifest = Path(path) / MANIFEST
    return Manifest.read(manifest).config if manifest.is_file() else {}


__all__ = ["ArtifactRef", "Manifest", "Registry", "registry", "weights_sha256", "artifact_name", "published_config",
           "KINDS",
           "MANIFEST"]
