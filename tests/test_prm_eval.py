"""PRM validation cases (prorag.prm_eval): each corruption of a gold step is a step the reference judge rejects
where it accepts the gold one; AUC per kind by hand."""

import random

import pytest

from prorag.data.loaders import Document
from prorag.judging import judge_step
from prorag.prm_eval import CORRUPTIONS, ProbeCase, auc_by_kind, corrupt
from prorag.sft_data import agent_steps
from tests.test_judging import DOC1, Q

DOC2 = Document(id="d2", title="Tova Lunn", text="Tova Lunn was born in Edraand.",
                contents='"Tova Lunn"\nTova Lunn was born in Edraand.')
GOLD = agent_steps(Q, {}, {"d1": DOC1, "d2": DOC2}, topk=1)
ENTITIES = ["Kora Vell", "Balorn Works", "Mai Brewery", "Tova Lunn"]
ANSWERS = ["Kora Vell", "Edraand", "Tova Lunn", "Balorn"]


@pytest.mark.parametrize("seed", range(5))
def test_every_kind_is_produced_and_only_the_corruption_is_rejected(seed):
    cases = corrupt(Q, GOLD, random.Random(seed), ENTITIES, ANSWERS)
    assert sorted(c.kind for c in cases) == sorted(CORRUPTIONS)
    for c in cases:
        assert c.context == GOLD[:c.position] and c.gold is GOLD[c.position]
        assert judge_step(Q, c.context, c.gold).sound, c.kind
        verdict = judge_step(Q, c.context, c.corrupted)
        assert not verdict.sound, (c.kind, c.corrupted)
    swapped = next(c for c in cases if c.kind == "swapped_entity")
    assert swapped.corrupted.content != swapped.gold.content and swapped.corrupted.kind == "subquery"
    unsupported = next(c for c in cases if c.kind == "unsupported_subanswer")
    docs_text = " ".join(d.text for d in GOLD[unsupported.position - 1].docs)
    assert unsupported.corrupted.content not in docs_text
    redundant = next(c for c in cases if c.kind == "redundant_search")
    assert redundant.corrupted.content in [s.content for s in redundant.context if s.kind == "subquery"]
    assert next(c for c in cases if c.kind == "premature_answer").corrupted.kind == "answer"


def test_one_hop_questions_get_only_the_corruptions_that_apply():
    from prorag.data.loaders import Question

    one = Question(id="q2", question="Who founded Mai Brewery?", golden_answers=["Tova Lunn"],
                   metadata={"decomposition": [{"question": "Who founded Mai Brewery?", "answer": "Tova Lunn",
                                                "doc_id": "d1", "title": "Mai Brewery"}]})
    steps = agent_steps(one, {}, {"d1": DOC1}, topk=1)
    kinds = {c.kind for c in corrupt(one, steps, random.Random(0), ENTITIES, ANSWERS)}
    assert kinds == {"swapped_entity", "unsupported_subanswer"}  # no later hop to repeat or skip


def test_auc_by_kind_by_hand():
    def case(kind):
        return ProbeCase("q", "?", kind, 0, [], GOLD[0], GOLD[0])

    cases = [case("swapped_entity"), case("swapped_entity"), case("redundant_search")]
    out = auc_by_kind(cases, [2.0, 0.5, 1.0], [1.0, 1.0, 3.0])
    # overall: positives {2.0, 0.5, 1.0} vs negatives {1.0, 1.0, 3.0}: wins 2 + 0 + 2 * 0.5 = 3 of 9
    assert out["overall"] == pytest.approx(3 / 9) and out["n"] == 3
    assert out["by_kind"]["swapped_entity"] == {"auc": pytest.approx(0.5), "n": 2}  # 2 > 1 (x2), 0.5 < 1 (x2)
    assert out["by_kind"]["redundant_search"] == {"auc": 0.0, "n": 1}
    with pytest.raises(ValueError):
        auc_by_kind(cases, [1.0], [0.0])
