"""TokenTrajectory: the one token-level type, built alike by SFT encoding and by rollouts, with
each step's span (generated part, then what the environment inserted after it)."""

import pytest

from prorag import trajectory as T
from prorag.engine import SamplingSpec
from prorag.rollout import decode, run_rollouts
from prorag.data.sft import encode_segments
from prorag.tokens import StepSpan, TokenTrajectory
from tests.test_rollout import SCRIPTS, TWO_HOP, ScriptedEngine, Searcher

QUESTION = "Where was the director of Inception born?"


def canonical_ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_spans_tile_the_sequence_after_the_prompt():
    t = TokenTrajectory.from_prompt([5, 6, 7])
    t.add_step([8, 9], [1.0, 3.0], [-0.5, -0.25])
    t.add_inserted([10])
    t.add_inserted([11, 12])
    t.add_step([13], [5.0])
    assert t.token_ids == list(range(5, 14)) and len(t) == 9 and t.prompt_length == 3
    assert t.generated_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1] and t.generated_tokens == 3
    assert t.weights == [0.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0, 5.0]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, 0.0]  # unknown log-probs are 0
    assert t.spans == [StepSpan(3, 5, 8), StepSpan(8, 9, 9)]
    assert t.token_ids[t.spans[0].generated] == [8, 9] and t.token_ids[t.spans[0].inserted] == [10, 11, 12]
    with pytest.raises(ValueError, match="needs 1 weights"):
        t.add_step([1], [])
    with pytest.raises(ValueError, match="follow a step"):
        TokenTrajectory.from_prompt([1]).add_inserted([2])


def _steps_with_docs():
    """TWO_HOP's steps, each subquery with the documents the scripted searcher gives (cut and cleaned as shown)."""
    search, steps = Searcher(), [T.parse_step(text) for text in TWO_HOP]
    for s in steps:
        if s.kind == "subquery":
            s.docs = [T.clean_doc(d) for d in search([s.content], 3)[0][:3]]
    return steps


def test_sft_encoding_and_rollout_give_the_same_tokens_and_spans(tiny_policy):
    tok = tiny_policy[1]
    steps = _steps_with_docs()
    tag_ids = {t: tok.convert_tokens_to_ids(t) for t in T.TAGS}  # as the SFT stage builds it
    sft = encode_segments(tok, T.render_prompt(QUESTION), steps, tag_ids, T.FORMAT_LOSS_WEIGHTS)
    engine = ScriptedEngine(tok, {QUESTION: TWO_HOP}, encode=canonical_ids)
    (r,) = run_rollouts(engine, tok, [("q0", QUESTION)], SamplingSpec(n=1, max_tokens=200, seed=3), Searcher(),
                        max_steps=6, topk=3)
    assert r.finish_reason == "answer" and [s.text for s in r.steps] == [s.text for s in steps]
    rolled = r.tokens
    assert rolled.token_ids == sft.token_ids and rolled.generated_mask == sft.generated_mask
    assert rolled.prompt_length == sft.prompt_length and rolled.spans == sft.spans and len(sft.spans) == 5
    assert rolled.weights == sft.weights  # the same format-aware weights, so rollouts can be trained on
    assert sft.logprobs == [0.0] * len(sft) and set(rolled.logprobs) == {0.0, -0.25}
    for tt in (sft, rolled):
        ids = tt.token_ids
        for step, span in zip(steps, tt.spans):
            assert decode(tok, ids[span.generated]) == step.text
            assert decode(tok, ids[span.inserted]) == T.glue_after(step)
        assert decode(tok, ids[:tt.prompt_length]) == T.render_prompt(QUESTION)


@pytest.mark.parametrize("encode", ["char", "canonical"])
def test_rollout_spans_match_steps_however_they_end(tiny_policy, encode):
    """Answer, invalid step and max_steps endings, with non-canonical ids too: each span decodes to its
    step's text and the glue inserted after it, and the spans tile the sequence."""
    tok = tiny_policy[1]
    engine = ScriptedEngine(tok, SCRIPTS) if encode == "char" else ScriptedEngine(tok, SCRIPTS, encode=canonical_ids)
    results = run_rollouts(engine, tok, [(f"q{i}", q) for i, q in enumerate(SCRIPTS)],
                           SamplingSpec(n=1, max_tokens=200, seed=3), Searcher(), max_steps=6, topk=3)
    assert {r.finish_reason for r in results} == {"answer", "invalid_format", "max_steps"}
    for r in results:
        t = r.tokens
        assert len(t.spans) == len(r.steps)
        assert [s.start for s in t.spans] == [t.prompt_length] + [s.end for s in t.spans[:-1]]
        assert t.spans[-1].end == len(t)
        for step, span in zip(r.steps, t.spans):
            assert decode(tok, t.token_ids[span.generated]) == step.text
            assert decode(tok, t.token_ids[span.inserted]) == T.glue_after(step)
            assert set(t.generated_mask[span.generated]) <= {1} and set(t.generated_mask[span.inserted]) <= {0}


def test_a_step_whose_glue_did_not_fit_has_an_empty_inserted_part(tiny_policy):
    tok = tiny_policy[1]
    limit = len(canonical_ids(tok, T.render_prompt(QUESTION))) + len(canonical_ids(tok, TWO_HOP[0])) + 5
    (r,) = run_rollouts(ScriptedEngine(tok, SCRIPTS, max_model_len=limit, encode=canonical_ids), tok,
                        [("a", QUESTION)], SamplingSpec(max_tokens=200), Searcher(), topk=3)
    assert r.finish_reason == "length" and r.steps[0].docs is None
    (span,) = r.tokens.spans
    assert span.generated_end == span.end == len(r.tokens)


def test_a_trajectory_round_trips_through_plain_data():
    import torch

    t = TokenTrajectory.from_prompt([1, 2])
    t.add_step([3, 4], [1.0, 5.0], [-0.5, -0.25])
    t.add_inserted([9])
    d = t.to_dict()
    assert TokenTrajectory.from_dict(d) == t
    import io

    buf = io.BytesIO()
    torch.save({"samples": [d]}, buf)
    buf.seek(0)
    assert TokenTrajectory.from_dict(torch.load(buf, weights_only=True)["samples"][0]) == t
