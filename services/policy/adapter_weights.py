"""The transformers engine's LoRA adapters: the base model and the adapters loaded on it, each either merged into a
copy of the base or as PEFT's LoRA layers on the shared base. Not locked: the engine calls it under its lock."""

from __future__ import annotations

import contextlib
import copy

import torch

from prorag.engine import already_loaded
from prorag.errors import FailedPrecondition, NotFound


class AdapterWeights:
    def __init__(self, base: torch.nn.Module, merge: bool):
        """merge: run each adapter as its own copy of the base with the LoRA weights merged in (one model copy of
        memory per adapter): every projection is then one matmul, not three plus PEFT's per-layer Python."""
        self.base = base
        self.merge = bool(merge)
        self._peft = None  # a PeftModel wrapping self.base once an adapter is loaded (merge off)
        self._adapters: dict[str, tuple[str, str]] = {}  # key -> (PEFT adapter name, path)
        self._merged: dict[str, torch.nn.Module] = {}  # key -> base copy with that adapter merged in
        self._counter = 0

    def keys(self) -> list[str]:
        return list(self._adapters)

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def served(self) -> list[torch.nn.Module]:
        """The modules that run requests: the base and each merged copy."""
        return [self.base, *self._merged.values()]

    def load(self, key: str, path: str, shown_path: str) -> bool:
        """Load the adapter at (resolved) ``path`` as ``key``; False when it already is (AlreadyExists from another
        path). shown_path: the path as the caller gave it, for messages."""
        if already_loaded(self._adapters, key, path):
            return False
        # imported at the first load: peft's import pulls in much of transformers (seconds), which a policy
        # serving only its base never needs
        from peft import PeftModel

        # PEFT names become module keys: a "." (as in "v1.2") would break them, so use our own
        self._counter += 1
        name = f"a{self._counter}"
        try:
            if self.merge:
                peft = PeftModel.from_pretrained(copy.deepcopy(self.base), path, adapter_name=name,
                                                 is_trainable=False)
                self._merged[key] = peft.merge_and_unload().eval()
            elif self._peft is None:
                self._peft = PeftModel.from_pretrained(self.base, path, adapter_name=name, is_trainable=False)
            else:
                self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except (ValueError, RuntimeError, KeyError) as e:
            raise FailedPrecondition(f"adapter {key!r} at {shown_path} does not fit the base model: {e}") from e
        if self._peft is not None:
            self._peft.eval()
        self._adapters[key] = (name, path)
        return True

    def unload(self, key: str) -> None:
        if key not in self._adapters:
            raise NotFound(f"adapter {key!r} is not loaded")
        name, _ = self._adapters.pop(key)
        if self._merged.pop(key, None) is not None:
            return
        if not self._adapters:
            # removing the last adapter strips the LoRA layers: the base runs as before any load
            self.base = self._peft.unload()
            self._peft = None
            return
        if self._peft.active_adapter == name:
            # move off the doomed adapter first (PEFT warns when the active one is deleted)
            self._peft.set_adapter(next(iter(self._adapters.values()))[0], inference_mode=True)
        self._peft.delete_adapter(name)

    def model_for(self, adapter: str | None) -> torch.nn.Module:
        return self._merged.get(adapter, self.base) if adapter is not None else self.base

    def context(self, adapter: str | None):
        """Around a generation on ``adapter`` (None = the base): PEFT's layers switched to it or off."""
        if self._peft is None:
            return contextlib.nullcontext()
        if adapter is None:
            return self._peft.disable_adapter()
        self._peft.set_adapter(self._adapters[adapter][0], inference_mode=True)
        return contextlib.nullcontext()
