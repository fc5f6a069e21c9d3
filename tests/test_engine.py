"""prorag.engine: the sampling a generate call takes, and which log-probs an engine can return."""

import pytest

from prorag.engine import SamplingSpec, check_generate, check_logprobs_served
from prorag.errors import FailedPrecondition, InvalidArgument


def spec(temperature, top_p=1.0, tempered: bool | None = False):
    return SamplingSpec(temperature=temperature, top_p=top_p, tempered_logprobs=tempered)


def test_an_engine_serving_both_kinds_takes_any_request():
    for s in (spec(0.7), spec(0.7, tempered=True), spec(1.0, 0.9, tempered=True), spec(0.0)):
        check_logprobs_served(s, "both", "transformers")


@pytest.mark.parametrize("served, request_spec, refused", [
    ("raw", spec(0.7, tempered=True), True),
    ("raw", spec(0.7), False),
    ("raw", spec(1.0, tempered=True), False),  # at temperature 1 with top_p 1 the kinds are the same numbers
    ("raw", spec(1.0, 0.9, tempered=True), True),  # ... but not under a nucleus
    ("raw", spec(0.0, tempered=True), False),  # greedy decoding: raw either way
    ("tempered", spec(0.7), True),
    ("tempered", spec(0.7, tempered=True), False),
    ("tempered", spec(1.0), False),
    ("tempered", spec(1.0, 0.9), True),
    ("tempered", spec(0.0), False),
    ("raw", spec(0.7, tempered=None), False),  # a caller that names no kind (it reads none) takes the engine's
    ("tempered", spec(0.7, tempered=None), False),
])
def test_an_engine_serving_one_kind_refuses_the_other_where_they_differ(served, request_spec, refused):
    if not refused:
        check_logprobs_served(request_spec, served, "vllm")
        return
    with pytest.raises(FailedPrecondition) as ei:
        check_logprobs_served(request_spec, served, "vllm")
    msg = str(ei.value)
    # the message names what the engine returns, what was asked, and the restart that serves it
    assert f"vllm engine returns {served} log-probs" in msg and "--set vllm_logprobs=" in msg


def test_check_generate_checks_the_kind_and_the_rest():
    with pytest.raises(FailedPrecondition):
        check_generate([[1, 2]], spec(0.5, tempered=True), None, 10, 8, "raw", "vllm")
    with pytest.raises(InvalidArgument, match="temperature"):
        check_generate([[1, 2]], spec(-1.0), None, 10, 8, "both", "transformers")
    check_generate([[1, 2]], spec(0.5, tempered=True), None, 10, 8)  # engines serving both: the default
    with pytest.raises(ValueError, match="served"):
        check_logprobs_served(spec(0.5), "processed", "vllm")
