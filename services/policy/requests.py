"""The policy's request checks: one place for the gRPC servicer and the OpenAI-compatible HTTP API.

Each front end turns its wire format into plain values (protobuf fields whose 0 means "the default"; JSON values
of any type, checked for type there) and asks these checks, so a request gets the same limits and the same
message whichever way it comes in. ``field`` prefixes the names in messages ("sampling." for gRPC's message).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from prorag.engine import SamplingSpec
from prorag.errors import InvalidArgument

#: characters per allowed token accepted before tokenising (a huge string would hold the event loop in the
#: tokenizer); generous for any text the token limit admits
CHARS_PER_TOKEN = 16


def _shown(value) -> str:
    """A caller's value as a message shows it: a JSON integer may be thousands of digits long."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


class RequestChecks:
    """Checks of one policy server's requests against its limits (``PolicyLimits``) and its model.

    stop_tags: the format's stop tags that are one token of this model (tag -> id), the default stops of a
    rollout step; any other single token of the model is accepted as a stop as well."""

    def __init__(self, limits, tokenizer, vocab_size: int, max_model_len: int, stop_tags: Mapping[str, int]):
        self.limits, self.tokenizer = limits, tokenizer
        self.vocab_size, self.max_model_len = int(vocab_size), int(max_model_len)
        self.stop_tags = dict(stop_tags)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: the configured limit, and room for one generated token in the model."""
        return min(self.limits.max_prefix_tokens, self.max_model_len - 1)

    def count(self, n: int, items: str, most: int) -> None:
        """A request's list of ``items`` (plural: "prefixes", "questions") is neither empty nor over ``most``."""
        if n == 0:
            raise InvalidArgument(f"{items} is empty")
        if n > most:
            raise InvalidArgument(f"{n} {items}; at most {most} per request")

    def text(self, i: int, text: str, what: str = "prefix") -> None:
        """A prompt text short enough to tokenise (checked before the tokenizer sees it)."""
        most = self.limits.max_prefix_tokens * CHARS_PER_TOKEN
        if len(text) > most:
            raise InvalidArgument(f"{what} {i} has {len(text):,} characters; at most {most:,}")

    def encode(self, i: int, text: str, what: str = "prefix") -> list[int]:
        """A prompt text's token ids, checked."""
        self.text(i, text, what)
        return self.prompt_ids(i, self.tokenizer.encode(text, add_special_tokens=False), what)

    def prompt_ids(self, i: int, ids: Sequence[int], what: str = "prefix") -> list[int]:
        """A prompt's token ids: not empty, inside the vocabulary, within :attr:`max_prompt_tokens`."""
        ids = list(ids)
        if not ids:
            raise InvalidArgument(f"{what} {i} is empty: give token_ids or text")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidArgument(f"{what} {i} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidArgument(f"{what} {i} has {len(ids)} tokens; at most {self.max_prompt_tokens} allowed")
        return ids

    def stop_ids(self, stops: Sequence[str]) -> tuple[int, ...]:
        """The token ids of ``stops`` (each one token of this model); none given = the format's stop tags."""
        if not stops:
            return tuple(self.stop_tags.values())
        out = []
        for s in stops:
            ids = self.tokenizer.encode(s, add_special_tokens=False) if isinstance(s, str) else []
            if len(ids) != 1:
                raise InvalidArgument(f"stop {s!r} is not one token of this model: give a stop tag "
                                      f"({', '.join(sorted(self.stop_tags))}) or another single token")
            out.append(ids[0])
        return tuple(out)

    def sampling(self, *, n: int, max_tokens: int, temperature: float, top_p: float, seed: int,
                 stops: Sequence[str], field: str = "", default_hint: bool = False,
                 tempered_logprobs: bool | None = None) -> SamplingSpec:
        """The sampling of a request; top_p 0 means 1. default_hint: the wire's 0 means the default (gRPC), so
        the message says so."""
        L = self.limits
        if n < 1:
            raise InvalidArgument(f"{field}n must be >= 1, got {_shown(n)}")
        if n > L.max_n:
            raise InvalidArgument(f"{field}n is {_shown(n)}; this server allows at most {L.max_n}")
        if not 1 <= max_tokens <= L.max_tokens:
            raise InvalidArgument(f"{field}max_tokens is {_shown(max_tokens)}; allowed 1..{L.max_tokens}"
                                  + (" (0 = default)" if default_hint else ""))
        # also NaN; JSON integers are unbounded, so the range is checked before float() could overflow
        if not 0 <= temperature <= 10:
            raise InvalidArgument(f"{field}temperature must be in [0, 10], got {_shown(temperature)}")
        if not 0 <= top_p <= 1:
            raise InvalidArgument(f"{field}top_p must be in (0, 1] (0 means 1), got {_shown(top_p)}")
        if not -2 ** 63 <= seed < 2 ** 63:
            raise InvalidArgument(f"{field}seed must be a 64-bit integer, got {_shown(seed)}")
        return SamplingSpec(n=int(n), temperature=float(temperature), top_p=float(top_p) or 1.0,
                            max_tokens=int(max_tokens), stop_token_ids=self.stop_ids(stops),
                            seed=int(seed), tempered_logprobs=tempered_logprobs).validate()


__all__ = ["CHARS_PER_TOKEN", "RequestChecks"]
