"""The generation-engine interface every engine implements (transformers, vLLM) and the rollout loop uses.

Prompts and outputs are token ids: the rollout loop carries ids across turns and never
re-encodes text. Every generated token comes with its log-prob: the raw one by default (log-softmax of the model's
logits at temperature 1, before top-p, what vLLM returns by default), or, when a call asks for tempered log-probs,
that of the distribution it sampled from (log-softmax of logits / temperature after top-p), which RL reads when it
samples at a temperature other than 1.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling for one generate call. temperature 0 = greedy; seed 0 = unseeded."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    #: True: log-probs of the distribution sampled from (logits / temperature, then top_p; vLLM's
    #: processed_logprobs); False: the raw logits' (greedy decoding draws from no distribution: raw either way);
    #: None: whichever the engine returns (raw where it can return both), for callers that do not read them
    tempered_logprobs: bool | None = None

    def validate(self) -> "SamplingSpec":
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidArgument(f"n must be >= 1, got {self.n!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        return self


@dataclass
class GeneratedSeq:
    """One completion: ids (the stop token included), their log-probs (raw, or tempered when asked), why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_token_id: int | None = None


def derive_seed(seed: int, *path: int) -> int:
    """A stable 63-bit seed for a sub-stream (sample j of prompt i, round r...); 0 stays 0 (unseeded).

    >>> derive_seed(0, 1, 2)
    0
    >>> derive_seed(7, 1) == derive_seed(7, 1) != derive_seed(7, 2)
    True
    """
    if seed == 0:
        return 0
    h = hashlib.blake2b(repr((int(seed),) + tuple(int(p) for p in path)).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "big") >> 1) or 1


def validate_adapter_dir(path: str | Path) -> Path:
    """The directory must hold adapter_config.json and adapter_model.safetensors (PEFT layout)."""
    p = Path(path)
    if not p.is_dir():
        raise NotFound(f"adapter directory {path} does not exist")
    missing = [f for f in ADAPTER_FILES if not (p / f).is_file()]
    if missing:
        raise InvalidArgument(f"adapter directory {path} lacks {', '.join(missing)}")
    return p


def already_loaded(adapters: dict, key: str, path: str) -> bool:
    """True if ``key`` is loaded from ``path`` (a no-op reload); AlreadyExists if from another path.

    adapters: key -> (engine handle, resolved path), as both engines keep them.
    """
    if key not in adapters:
        return False
    if adapters[key][1] == path:
        return True
    raise AlreadyExists(f"adapter {key!r} is already loaded from {adapters[key][1]}")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_model_len: int) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise InvalidArgument("prompts must be a list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InvalidArgument(f"prompt {i} is empty")
        if len(p) >= max_model_len:
            raise InvalidArgument(f"prompt {i} has {len(p)} tokens; the model holds at most {max_model_len} "
                                  "(prompt + at least one generated token)")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise InvalidArgument(f"prompt {i} has token id {lo if lo < 0 else hi} outside [0, {vocab_size})")


#: the log-probs an engine can return: "both" (raw or tempered, as each call asks) or one kind engine-wide
LOGPROBS_SERVED = ("both", "raw", "tempered")


def check_logprobs_served(params: SamplingSpec, served: str, engine: str) -> None:
    """FailedPrecondition when an engine that returns one kind of log-probs (``served``: "raw" or "tempered", vLLM's
    logprobs_mode) is asked for the other; the two coincide at temperature 0 and at temperature 1 with top_p 1. A
    call that names no kind (tempered_logprobs None) takes the engine's."""
    if served not in LOGPROBS_SERVED:
        raise ValueError(f"served must be one of {LOGPROBS_SERVED}, got {served!r}")
    if served == "both" or params.tempered_logprobs is None:
        return
    same = params.temperature == 0 or (params.temperature == 1 and params.top_p == 1)
    asked = "tempered" if params.tempered_logprobs else "raw"
    if asked != served and not same:
        raise FailedPrecondition(
            f"this policy's {engine} engine returns {served} log-probs and the request asks for {asked} ones at "
            f"temperature {params.temperature:g}: ask for {served} ones, or restart the policy with "
            f"--set vllm_logprobs={asked}")


def check_generate(prompts: Sequence[Sequence[int]], params: SamplingSpec, seeds: Sequence[int] | None,
                   vocab_size: int, max_model_len: int, logprobs_served: str = "both", engine: str = "") -> None:
    """What every engine's ``generate`` checks before it samples: the sampling (and that the engine returns the
    log-probs it asks for), each prompt against the model, and one seed per prompt when seeds are given."""
    params.validate()
    check_logprobs_served(params, logprobs_served, engine)
    check_prompts(prompts, vocab_size, max_model_len)
    if seeds is not None and len(seeds) != len(prompts):
        raise InvalidArgument(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")


class GenerationEngine(abc.ABC):
    """What the policy service needs from an engine (transformers or vLLM).

    ``generate`` runs every prompt x n samples under one adapter (``None`` = the base model);
    adapters are addressed by caller-chosen keys (the service uses "name@version").
    """

    name: str = "abstract"
    tokenizer = None
    max_model_len: int = 0
    #: generate calls the service may have in flight at once: 1 for an engine that batches only within a call
    #: (concurrent callers are merged into its next call), more for one that batches across calls itself (vLLM)
    concurrent_calls: int = 1
    #: which log-probs ``generate`` returns (LOGPROBS_SERVED): both kinds per call, or one chosen at start (vLLM)
    logprobs_served: str = "both"

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec, adapter: str | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[GeneratedSeq]]:
        """[P prompts] -> [P][n] completions. ``seeds`` (one per prompt) overrides params.seed."""

    @abc.abstractmethod
    def load_adapter(self, key: str, path: str) -> None:
        """Load a PEFT LoRA directory under ``key``; the same key and path again is a no-op."""

    @abc.abstractmethod
    def unload_adapter(self, key: str) -> None: ...

    @abc.abstractmethod
    def adapters(self) -> list[str]: ...

    @abc.abstractmethod
    def info(self) -> dict: ...

    def close(self) -> None:
        """Release resources (optional)."""


