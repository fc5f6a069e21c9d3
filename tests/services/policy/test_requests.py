"""The policy's request checks (services.policy.requests), shared by the gRPC servicer and the HTTP API: the
same limits and messages whichever wire a request comes by."""

from __future__ import annotations

import math

import pytest

from prorag.errors import InvalidArgument
from services.policy.requests import CHARS_PER_TOKEN, RequestChecks
from services.policy.config import PolicyConfig


class WordTokenizer:
    """One token per known word (ids 1..), anything else one token per character from 100: enough to say which
    strings are single tokens."""

    VOCAB = {"</subquery>": 1, "</answer>": 2, "<|im_end|>": 3, "hello": 4}

    def encode(self, text, add_special_tokens=False):
        return [self.VOCAB[text]] if text in self.VOCAB else [100 + (ord(c) % 50) for c in text]


def checks(**limits) -> RequestChecks:
    cfg = PolicyConfig(model="m", max_n=8, max_tokens=64, max_prefix_tokens=10, max_prefixes=4, **limits)
    return RequestChecks(cfg, WordTokenizer(), vocab_size=200, max_model_len=32,
                         stop_tags={"</subquery>": 1, "</answer>": 2})


def sampling(c, field="", **kw):
    args = dict(n=1, max_tokens=8, temperature=1.0, top_p=0.0, seed=0, stops=[])
    args.update(kw)
    return c.sampling(field=field, **args)


def test_sampling_defaults_and_stops():
    c = checks()
    spec = sampling(c)
    assert spec.top_p == 1.0 and spec.stop_token_ids == (1, 2)  # top_p 0 means 1; no stops = the format's tags
    assert sampling(c, stops=["<|im_end|>", "hello"]).stop_token_ids == (3, 4)  # any single token of the model
    with pytest.raises(InvalidArgument, match="not one token of this model: give a stop tag"):
        sampling(c, stops=["</nope>"])


@pytest.mark.parametrize("kw, message", [
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"n": 9}, "n is 9; this server allows at most 8"),
    ({"max_tokens": 0}, "max_tokens is 0; allowed 1..64"),
    ({"max_tokens": 10 ** 400}, "max_tokens is 10000000000000000000...(401 characters); allowed 1..64"),
    ({"temperature": math.nan}, "temperature must be in [0, 10]"),
    ({"temperature": -0.5}, "temperature must be in [0, 10]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": -1.0}, "top_p must be in (0, 1]"),
    ({"seed": 2 ** 63}, "seed must be a 64-bit integer"),
])
def test_sampling_refusals_name_the_field_of_either_wire(kw, message):
    c = checks()
    with pytest.raises(InvalidArgument) as http:
        sampling(c, **kw)
    with pytest.raises(InvalidArgument) as grpc_:
        sampling(c, field="sampling.", default_hint=True, **kw)
    assert str(http.value).startswith(message)
    assert str(grpc_.value) == "sampling." + str(http.value) + (" (0 = default)" if "max_tokens" in kw else "")


def test_prompts_one_length_rule_for_both_wires():
    c = checks()
    assert c.max_prompt_tokens == 10  # min(max_prefix_tokens 10, max_model_len 32 - 1)
    assert c.prompt_ids(0, [5] * 10) == [5] * 10  # exactly the limit is accepted
    with pytest.raises(InvalidArgument, match="prefix 1 has 11 tokens; at most 10 allowed"):
        c.prompt_ids(1, [5] * 11)
    with pytest.raises(InvalidArgument, match="prompt 0 is empty"):
        c.prompt_ids(0, [], "prompt")
    with pytest.raises(InvalidArgument, match=r"token id 200 outside the vocabulary \[0, 200\)"):
        c.prompt_ids(0, [1, 200])
    with pytest.raises(InvalidArgument, match="token id -1"):
        c.prompt_ids(0, [-1])
    short_model = RequestChecks(PolicyConfig(model="m", max_prefix_tokens=100), WordTokenizer(), 200, 8, {})
    assert short_model.max_prompt_tokens == 7  # room for one generated token


def test_texts_are_bounded_before_tokenising_and_counts_checked():
    c = checks()
    most = 10 * CHARS_PER_TOKEN
    c.text(0, "x" * most)
    with pytest.raises(InvalidArgument, match=f"message 2 has {most + 1:,} characters; at most {most:,}"):
        c.text(2, "x" * (most + 1), "message")
    with pytest.raises(InvalidArgument, match="prefix 0 has"):
        c.encode(0, "x" * (most + 1))
    assert c.encode(0, "hello") == [4]
    with pytest.raises(InvalidArgument, match="^prefixes is empty$"):
        c.count(0, "prefixes", 4)
    with pytest.raises(InvalidArgument, match="^5 prompts; at most 4 per request$"):
        c.count(5, "prompts", 4)
    c.count(4, "prompts", 4)
