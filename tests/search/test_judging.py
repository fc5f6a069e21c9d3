"""The reference judge's rules (prorag.search.judging) on a hand-built two-hop question."""

from prorag.data.loaders import Document, Question
from prorag.search.judging import (REDUNDANT_SEARCH, UNSUPPORTED, WRONG_ANSWER, WRONG_ENTITY, INVALID, judge_pair,
                            judge_step, open_hop)
from prorag.trajectory import Step

Q = Question(id="q1", question="In which country was the founder of Mai Brewery born?", golden_answers=["Edraand"],
             metadata={"decomposition": [
                 {"question": "Who founded Mai Brewery?", "answer": "Tova Lunn", "doc_id": "d1",
                  "title": "Mai Brewery"},
                 {"question": "Where was Tova Lunn born?", "answer": "Edraand", "doc_id": "d2", "title": "Tova Lunn"}]})

DOC1 = Document(id="d1", title="Mai Brewery", text="Mai Brewery was founded by Tova Lunn.",
                contents='"Mai Brewery"\nMai Brewery was founded by Tova Lunn.')
SEARCH1 = Step("subquery", content="Who founded Mai Brewery?", docs=[DOC1])


def test_open_hop_moves_when_a_hop_is_answered():
    assert open_hop(Q, []) == 0
    assert open_hop(Q, [SEARCH1, Step("subanswer", content="Tova Lunn")]) == 1
    assert open_hop(Q, [SEARCH1, Step("subanswer", content="Tova Lunn"), Step("subanswer", content="Edraand")]) is None


def test_subquery_rules():
    assert judge_step(Q, [], SEARCH1).sound
    assert judge_step(Q, [], Step("subquery", content="Who founded Tova Lunn?")).reason == WRONG_ENTITY
    assert judge_step(Q, [SEARCH1], Step("subquery", content="who founded mai brewery")).reason == REDUNDANT_SEARCH
    done = [SEARCH1, Step("subanswer", content="Tova Lunn"), Step("subanswer", content="Edraand")]
    assert judge_step(Q, done, Step("subquery", content="Where is Edraand?")).reason == REDUNDANT_SEARCH


def test_subanswer_rules():
    assert judge_step(Q, [SEARCH1], Step("subanswer", content="Tova Lunn")).sound
    assert judge_step(Q, [SEARCH1], Step("subanswer", content="Kora Vell")).reason == WRONG_ANSWER
    # right answer, but the search that came before did not return it
    other = Step("subquery", content="Who founded Mai Brewery?", docs=[])
    assert judge_step(Q, [other], Step("subanswer", content="Tova Lunn")).reason == UNSUPPORTED


def test_answer_and_invalid():
    assert judge_step(Q, [], Step("answer", content="Edraand")).sound
    assert judge_step(Q, [], Step("answer", content="Balorn")).reason == WRONG_ANSWER
    assert judge_step(Q, [], Step("invalid", text="When wasWho")).reason == INVALID


def test_pairs_choose_or_decline():
    good, bad = SEARCH1, Step("subquery", content="Who founded Tova Lunn?")
    j = judge_pair(Q, [], bad, good)
    assert (j.chosen, j.rejected) == (1, 0) and WRONG_ENTITY in j.reason
    assert judge_pair(Q, [], good, good).chosen is None
    assert judge_pair(Q, [], bad, bad).chosen is None


def test_parse_pair_reply():
    import pytest

    from prorag.errors import Unavailable
    from prorag.search.judging import MalformedJudgeReply, parse_pair_reply

    j = parse_pair_reply('```json\n{"chosen": 2, "reason": "step 1 names the wrong entity"}\n```')
    assert (j.chosen, j.rejected) == (1, 0) and "wrong entity" in j.reason
    assert parse_pair_reply('{"chosen": "1"}').chosen == 0
    assert parse_pair_reply('{"chosen": null, "reason": "tie"}').chosen is None
    for bad in ("no json here", '{"chosen": 3}', '{"reason": "x"}', '{"chosen": 1,,}', '{"chosen": true}'):
        with pytest.raises(MalformedJudgeReply):
            parse_pair_reply(bad)
    assert issubclass(MalformedJudgeReply, Unavailable)


def test_request_key_is_content_keyed():
    from prorag.search.judging import pair_messages, request_key

    m = pair_messages("Q?", "", "a", "b")
    assert request_key("gpt-4o", m, {"temperature": 0}) == request_key("gpt-4o", m, {"temperature": 0})
    assert request_key("gpt-4o", m, {"temperature": 0}) != request_key("gpt-4o", pair_messages("Q?", "", "b", "a"),
                                                                       {"temperature": 0})
    assert request_key("gpt-4o", m, {}) != request_key("gpt-4o-mini", m, {})
