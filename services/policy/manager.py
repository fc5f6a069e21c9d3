"""Adapter lifecycle in the policy service: verify -> load -> warm -> switch -> drain -> unload.

Requests pin the adapter they start with (``acquire``), so an activation never changes the
weights under a request in flight; unloading drains the pinned ones (new pins refused, in-flight
requests finish) before the engine drops the weights.

Every check-and-change of ``loaded``/``active`` happens under one asyncio lock (one event loop owns
them), so these invariants hold between any two awaits: the active adapter is loaded and not
draining, and one adapter has at most one unload in progress. Unloading the active adapter is
refused (FAILED_PRECONDITION) rather than silently falling back to the base model: a push that
unloads what serves traffic is almost always a mistake, and the fix (activate another version or
the base first) is one call away.

Every activation is recorded in the adapter root (one file per base model), so a replica that (re)starts
restores what the others serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Info

from prorag.errors import FailedPrecondition, NotFound, ProragError
from prorag.io import write_json
from prorag.registry import ArtifactRef, Manifest, Registry
from prorag.engine import GenerationEngine, SamplingSpec


ADAPTER_INFO = Info("prorag_policy_adapter", "What new policy requests run: the active adapter name@version ('' = "
                    "the base model alone) and the base model (first 16 hex digits of its weights' sha256)")


ACTIVE_FILE = "ACTIVE.json"


def active_file(adapter_root, base_sha256: str) -> Path:
    """Where the active adapter of replicas serving the base model ``base_sha256`` is recorded.

    One file per base model: one adapter root (a world's) holds adapters of several bases (the SFT model's
    outcome-only GRPO, the RFT model's ProRAG RL), and a replica started on one base must not restore an
    adapter trained on another."""
    return Path(adapter_root) / (f"ACTIVE-{base_sha256[:16]}.json" if base_sha256 else ACTIVE_FILE)


def record_active(adapter_root, ref: ArtifactRef | None, base_sha256: str = "") -> None:
    """Write what is active into the shared adapter root, so that a replica of the same base model that
    (re)starts serves the same version as the others (see :func:`read_active`). Every replica of a push writes
    the same content."""
    write_json(active_file(adapter_root, base_sha256), {"name": ref.name, "version": ref.version} if ref else {})


def read_active(adapter_root, base_sha256: str = "") -> ArtifactRef | None:
    path = active_file(adapter_root, base_sha256)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return ArtifactRef.of(data["name"], data["version"]) if data.get("name") else None


@dataclass
class LoadedAdapter:
    ref: ArtifactRef
    path: Path
    manifest: Manifest
    in_flight: int = 0
    draining: bool = False


@dataclass
class AdapterManager:
    engine: GenerationEngine
    root: Path
    base_model: str
    base_model_sha256: str
    loaded: dict[str, LoadedAdapter] = field(default_factory=dict)
    active: str | None = None  # "name@version" or None = base model
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self._publish_active()

    def _publish_active(self) -> None:
        ADAPTER_INFO.info({"active": self.active or "", "base_model_sha256": self.base_model_sha256[:16]})

    async def load(self, ref: ArtifactRef, path: str = "") -> LoadedAdapter:
        async with self._lock:
            return await self._load_locked(ref, path)

    async def _load_locked(self, ref: ArtifactRef, path: str) -> LoadedAdapter:
        entry = self.loaded.get(ref.key)
        if entry is not None:
            if entry.draining:
                raise FailedPrecondition(f"adapter {ref} is being unloaded; load it again once UnloadAdapter returns")
            return entry
        resolved, manifest = Registry(self.root, "adapter").verify(ref, path,
                                                                     base_model_sha256=self.base_model_sha256)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.load_adapter, ref.key, str(resolved))
        # Warm: one token through the new weights, so the first real request pays no lazy init.
        warm_prompt = [[int(self.engine.tokenizer.eos_token_id or 0)]]
        await loop.run_in_executor(None, lambda: self.engine.generate(
            warm_prompt, SamplingSpec(n=1, temperature=0.0, max_tokens=1), ref.key))
        entry = LoadedAdapter(ref, resolved, manifest)
        self.loaded[ref.key] = entry
        return entry

    async def activate(self, ref: ArtifactRef | None, path: str = "") -> str | None:
        """Make ``ref`` (None = base model) what new requests use; loads it first if needed.

        Load and switch happen under one lock hold, so an Unload of ``ref`` cannot slip in between
        and leave an unloaded adapter active. An adapter that is being unloaded cannot be activated
        (FAILED_PRECONDITION): load it again after the unload returns. The record in the adapter root
        (:func:`record_active`) is written under the same hold, so concurrent activations leave it naming
        the last one."""
        async with self._lock:
            key = await self._switch_locked(ref, path)
            await asyncio.to_thread(record_active, self.root, ref, self.base_model_sha256)
            return key

    async def restore_active(self) -> ArtifactRef | None:
        """At a replica's start: activate the adapter the adapter root records for this base model (None when it
        records none). Not recorded again: an activation on the running replicas meanwhile keeps its record."""
        ref = await asyncio.to_thread(read_active, self.root, self.base_model_sha256)
        if ref is None:
            return None
        async with self._lock:
            try:
                await self._switch_locked(ref, "")
            except ProragError as e:
                raise FailedPrecondition(
                    f"{active_file(self.root, self.base_model_sha256)} says {ref} is the active adapter, but it "
                    f"cannot be loaded: {e}; publish it again, or activate another version on the running replicas "
                    "(or start with restore_active=false)") from e
        return ref

    async def _switch_locked(self, ref: ArtifactRef | None, path: str) -> str | None:
        if ref is None:
            self.active = None
            self._publish_active()
            return None
        entry = await self._load_locked(ref, path)
        if entry.draining:  # defensive: _load_locked refuses a draining entry already
            raise FailedPrecondition(f"adapter {ref} is being unloaded; load it again once UnloadAdapter returns")
        self.active = ref.key
        self._publish_active()
        return self.active

    async def unload(self, ref: ArtifactRef, drain_timeout_s: float = 30.0) -> None:
        """Drain, then unload: new requests can no longer pin ``ref``; those in flight finish first
        (up to ``drain_timeout_s``, then FAILED_PRECONDITION and the adapter stays loaded).

        The active adapter is refused with FAILED_PRECONDITION (activate another version or the base
        model first); so is an adapter another Unload is already draining."""
        async with self._lock:
            entry = self.loaded.get(ref.key)
            if entry is None:
                raise NotFound(f"adapter {ref} is not loaded (loaded: {', '.join(self.loaded) or 'none'})")
            if self.active == ref.key:
                raise FailedPrecondition(f"adapter {ref} is active; activate another version or the base model "
                                         f"before unloading it")
            if entry.draining:
                raise FailedPrecondition(f"adapter {ref} is already being unloaded by another request")
            entry.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while entry.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.005)
        async with self._lock:
            if entry.in_flight:
                entry.draining = False
                raise FailedPrecondition(f"adapter {ref} still serves {entry.in_flight} request(s) after "
                                         f"{drain_timeout_s:.0f}s of draining; retry later")
            # No re-check of `active` needed: while draining, activate and load refused this entry.
            del self.loaded[ref.key]
            await loop.run_in_executor(None, self.engine.unload_adapter, ref.key)

    def resolve(self, requested: str) -> str | None:
        """The adapter a new request runs on: the named one (must be loaded) or the active one."""
        if not requested:
            return self.active
        key = ArtifactRef.parse(requested).key
        if key in self.loaded and self.loaded[key].draining:
            raise FailedPrecondition(f"adapter {key} is being unloaded; use the active version")
        if key not in self.loaded:
            raise NotFound(f"adapter {key} is not loaded (loaded: {', '.join(self.loaded) or 'none'}); "
                           f"call LoadAdapter first")
        return key

    @contextlib.contextmanager
    def acquire(self, requested: str = ""):
        """Pin the adapter for one request's whole life; yields its key (None = base)."""
        key = self.resolve(requested)
        entry = self.loaded.get(key) if key else None
        if entry:
            entry.in_flight += 1
        try:
            yield key
        finally:
            if entry:
                entry.in_flight -= 1
