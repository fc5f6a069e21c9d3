"""Sibling pairs round-trip through JSON; the PRM's one rendering puts a step at the same ids in a pair and in
its whole trajectory."""

import json

import pytest

from prorag.data.loaders import Document
from prorag.errors import InvalidArgument
from prorag.search.pairs import StepPair, label_agreement, prm_inputs
from prorag.trajectory import Step

DOC = Document(id="d1", title="Mai Brewery", text="Mai Brewery was founded by Tova Lunn.",
               contents='"Mai Brewery"\nMai Brewery was founded by Tova Lunn.')
SEARCH = Step("subquery", thought="First the founder.", content="Who founded Mai Brewery?", docs=[DOC])
GOOD = Step("subanswer", thought="The document says so.", content="Tova Lunn")
BAD = Step("subanswer", thought="I guess.", content="Kora Vell")


def _pair(value_choice=0, judge_choice=0):
    return StepPair("q1", "Who founded Mai Brewery?", [SEARCH], (GOOD, BAD), values=(0.9, 0.1), visits=(4, 3),
                    value_choice=value_choice, judge_choice=judge_choice, judge_reason="rejected: wrong answer")


def test_round_trip():
    p = _pair()
    q = StepPair.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q.to_dict() == p.to_dict()
    assert q.context[0].docs[0].title == "Mai Brewery"
    with pytest.raises(InvalidArgument):
        StepPair.from_dict({**p.to_dict(), "steps": [p.to_dict()["steps"][0]]})
    with pytest.raises(InvalidArgument):
        StepPair.from_dict({**p.to_dict(), "judge_choice": 2})
    with pytest.raises(InvalidArgument):
        StepPair.from_dict({**p.to_dict(), "steps": [{"kind": "dance"}, {"kind": "answer"}]})


def test_labels_and_agreement():
    pairs = [_pair(0, 0), _pair(0, 1), _pair(1, None), _pair(None, None)]
    assert pairs[1].label("both") is None and pairs[0].label("both") == 0 and pairs[1].label("judge") == 1
    with pytest.raises(InvalidArgument):
        pairs[0].label("vibes")
    a = label_agreement(pairs)
    assert (a["both_labelled"], a["agree"], a["agreement"], a["value_only"], a["neither"]) == (2, 1, 0.5, 1, 1)


def test_pair_and_trajectory_render_a_step_identically(tiny_policy):
    _, tok = tiny_policy
    answer = Step("answer", thought="Done.", content="Tova Lunn")
    whole_ids, whole_pos = prm_inputs(tok, "Who founded Mai Brewery?", [SEARCH, GOOD, answer])
    pair_ids, pair_pos = prm_inputs(tok, "Who founded Mai Brewery?", [SEARCH, GOOD])
    assert len(whole_pos) == 3 and len(pair_pos) == 2
    assert pair_pos == whole_pos[:2]
    assert pair_ids == whole_ids[:pair_pos[-1] + 1]
    # every step is read at the same kind of token: the one closing its span
    assert len({whole_ids[p] for p in whole_pos[:2]}) == 1
    with pytest.raises(InvalidArgument):
        prm_inputs(tok, "Q?", [])
