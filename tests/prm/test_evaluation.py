"""PRM validation cases (prorag.prm.evaluation): each corruption of a gold step is a step the reference judge rejects
where it accepts the gold one, in-distribution and held-out families alike, each carrying its own flaw; AUC per
kind and per group by hand; the gate on hand-made reports."""

import random

import pytest

from prorag.data.loaders import Document
from prorag.search.judging import judge_step
from prorag.errors import InvalidArgument
from prorag.metrics import cover_exact_match, normalize_answer
from prorag.prm.evaluation import (CORRUPTIONS, FAMILIES, HELD_OUT, ProbeCase, auc_by_kind, corrupt, corrupt_held_out,
                             document_names, prm_gate, validation_cases)
from prorag.data.sft import agent_steps
from prorag.trajectory import Step
from tests.search.test_judging import DOC1, Q

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
    assert out["in_distribution"]["auc"] == pytest.approx(3 / 9)
    assert out["in_distribution"]["kinds"] == ["swapped_entity", "redundant_search"]
    assert out["held_out"] == {"auc": None, "n": 0, "kinds": []}
    with pytest.raises(ValueError):
        auc_by_kind(cases, [1.0], [0.0])


def test_auc_groups_pool_in_distribution_and_held_out_families_apart():
    def case(kind):
        return ProbeCase("q", "?", kind, 0, [], GOLD[0], GOLD[0])

    cases = [case("unsupported_subanswer"), case("in_document_distractor"), case("skipped_hop")]
    out = auc_by_kind(cases, [1.0, 1.0, 3.0], [0.0, 2.0, 2.5])
    assert out["in_distribution"] == {"auc": 1.0, "n": 1, "kinds": ["unsupported_subanswer"]}
    # held out: positives {1.0, 3.0} vs negatives {2.0, 2.5}: 3.0 beats both, 1.0 neither: 2 of 4
    assert out["held_out"] == {"auc": pytest.approx(0.5), "n": 2,
                               "kinds": ["in_document_distractor", "skipped_hop"]}
    # overall pools every family: {1, 1, 3} vs {0, 2, 2.5}: 1 + 1 + 3 wins of 9
    assert out["overall"] == pytest.approx(5 / 9)
    assert list(out["by_kind"]) == ["unsupported_subanswer", "in_document_distractor", "skipped_hop"]


# ---------------------------------------------------------------- held-out families
# the same two-hop question (Mai Brewery's founder Tova Lunn, born in Edraand), with documents that name more
# than the answer, and the world's near misses of its entities
RICH1 = Document.from_parts("d1", "Mai Brewery", "Mai Brewery was founded in 1871 by Tova Lunn in Balorn. "
                                                 "Its first brewer was Kora Vell.")
RICH2 = Document.from_parts("d2", "Tova Lunn", "Tova Lunn was born in Edraand. She studied in Vessport "
                                               "under Ilma Oster.")
RICH = agent_steps(Q, {}, {"d1": RICH1, "d2": RICH2}, topk=1)
WORLD = ["Kora Vell", "Balorn Works", "Mai Brewery", "Mai Harbour", "Tova Lunn", "Edraand", "Ilma Oster"]


def _docs_before(case):
    return case.context[-1].docs or []


def _check_contrast(question, case, steps):
    assert case.context == list(steps[:case.position]) and case.gold is steps[case.position]
    assert judge_step(question, case.context, case.gold).sound, case.kind
    assert not judge_step(question, case.context, case.corrupted).sound, (case.kind, case.corrupted)
    # never the gold step again, not even up to case and punctuation
    assert (case.corrupted.kind, normalize_answer(case.corrupted.content)) != \
        (case.gold.kind, normalize_answer(case.gold.content)), case.kind


@pytest.mark.parametrize("seed", range(8))
def test_every_held_out_family_is_built_and_carries_its_flaw(seed):
    cases = {c.kind: c for c in corrupt_held_out(Q, RICH, random.Random(seed), WORLD)}
    assert set(cases) == set(HELD_OUT)
    for c in cases.values():
        _check_contrast(Q, c, RICH)

    # in-document distractor: a name that IS in the documents just read, but is neither the answer nor the entity
    # searched; the answer is a name, so the year 1871 (also in the document) is not chosen
    c = cases["in_document_distractor"]
    assert c.corrupted.kind == "subanswer" and c.corrupted.thought == c.gold.thought
    assert any(cover_exact_match(d.contents, [c.corrupted.content]) == 1.0 for d in _docs_before(c))
    assert c.corrupted.content in {"Balorn", "Kora Vell", "Vessport", "Ilma Oster"}
    # previous answer repeated: the last name the context stated (the question's entity before any)
    c = cases["previous_answer_repeated"]
    stated = [s.content for s in c.context if s.kind == "subanswer"]
    assert c.corrupted.kind == "subanswer" and c.corrupted.content == (stated[-1] if stated else "Mai Brewery")
    # wrong final from chain: the final answer, every hop read, naming the intermediate hop's answer
    c = cases["wrong_final_from_chain"]
    assert c.position == len(RICH) - 1 and c.corrupted.kind == "answer" and c.corrupted.content == "Tova Lunn"
    # partial entity: a subquery naming a near miss of the open hop's entity, one word off it
    c = cases["partial_entity"]
    right = {0: "Mai Brewery", 2: "Tova Lunn"}[c.position]
    assert c.corrupted.kind == "subquery" and right not in c.corrupted.content
    near = {"Mai Brewery": {"Mai", "Brewery", "Mai Harbour"}, "Tova Lunn": {"Tova", "Lunn"}}[right]
    assert any(c.corrupted.content == c.gold.content.replace(right, n) for n in near), c.corrupted
    # skipped hop: at the first search, the second hop's subquery, naming an answer no step has stated yet
    c = cases["skipped_hop"]
    assert c.position == 0 and c.corrupted.content == "Where was Tova Lunn born?" and c.context == []
    # answer without reading: an answer right after a search whose documents were not read, hops still to go
    c = cases["answer_without_reading"]
    assert c.position == 1 and c.context[-1].kind == "subquery" and c.corrupted.kind == "answer"
    assert c.corrupted.content == "Tova Lunn" and c.corrupted.thought == RICH[-1].thought


def test_the_distractor_has_the_answers_type():
    from prorag.data.loaders import Question

    year = Question(id="q3", question="In what year was the founder of Mai Brewery born?", golden_answers=["1902"],
                    metadata={"decomposition": [
                        {"question": "Who founded Mai Brewery?", "answer": "Tova Lunn", "doc_id": "d1",
                         "title": "Mai Brewery"},
                        {"question": "In what year was Tova Lunn born?", "answer": "1902", "doc_id": "d2",
                         "title": "Tova Lunn"}]})
    d2 = Document.from_parts("d2", "Tova Lunn", "Tova Lunn was born in 1902 in Edraand. In 1931 she moved to "
                                                "Vessport.")
    steps = agent_steps(year, {}, {"d1": RICH1, "d2": d2}, topk=1)
    got = set()
    for seed in range(20):
        for c in corrupt_held_out(year, steps, random.Random(seed), WORLD, families=["in_document_distractor"]):
            _check_contrast(year, c, steps)
            got.add((c.position, c.corrupted.content))
    # hop 2's answer is a year: its distractor is the other year, never a place; hop 1's (a name) is a name
    assert {content for pos, content in got if pos == 3} == {"1931"}
    assert {content for pos, content in got if pos == 1} <= {"Balorn", "Kora Vell"}


def test_held_out_families_from_the_agents_own_correct_trajectory():
    """Another team's protocol: the agent's own correct trajectory (its own phrasing, three documents per search,
    a thought of its own), one step corrupted: positions follow the judge's open hop, not a gold layout."""
    other = Document.from_parts("d9", "Mai Harbour", "Mai Harbour lies in Balorn.")
    own = [Step("subquery", thought="First the founder.", content="founder of Mai Brewery",
                docs=[other, RICH1, RICH2]),
           Step("subanswer", thought="Read it.", content="Tova Lunn"),
           Step("subquery", thought="Now the birthplace.", content="Tova Lunn birthplace", docs=[RICH2, other]),
           Step("subanswer", thought="Found.", content="Edraand"),
           Step("answer", thought="So the answer is", content="Edraand")]
    kinds = set()
    for seed in range(10):
        for c in corrupt_held_out(Q, own, random.Random(seed), WORLD):
            _check_contrast(Q, c, own)
            kinds.add(c.kind)
            if c.kind == "in_document_distractor":
                # another retrieved document's title counts: it was in what the agent read
                assert any(cover_exact_match(d.contents, [c.corrupted.content]) == 1.0 for d in _docs_before(c))
            if c.kind == "skipped_hop":
                assert c.corrupted.content == "Tova Lunn birthplace"
    assert kinds == set(HELD_OUT)
    with pytest.raises(InvalidArgument, match="unknown held-out families"):
        corrupt_held_out(Q, own, random.Random(0), WORLD, families=["swapped_entity"])


def test_a_one_hop_question_gets_only_the_held_out_families_that_apply():
    from prorag.data.loaders import Question

    one = Question(id="q2", question="Who founded Mai Brewery?", golden_answers=["Tova Lunn"],
                   metadata={"decomposition": [{"question": "Who founded Mai Brewery?", "answer": "Tova Lunn",
                                                "doc_id": "d1", "title": "Mai Brewery"}]})
    steps = agent_steps(one, {}, {"d1": RICH1}, topk=1)
    cases = corrupt_held_out(one, steps, random.Random(0), WORLD)
    # no later hop to skip to or to answer before, no intermediate answer to give as the final one
    assert {c.kind for c in cases} == {"in_document_distractor", "previous_answer_repeated", "partial_entity"}
    for c in cases:
        _check_contrast(one, c, steps)


def test_document_names():
    assert document_names("The Gentle Fountain is an album. The album sold 45000 copies. Ind Sound released "
                          "it. Born in Namouth, she ...") == ["The Gentle Fountain", "45000", "Ind Sound", "Namouth"]


def test_validation_cases_keep_the_in_distribution_draws_and_drop_what_is_no_contrast():
    from prorag.data.loaders import Question

    # the judge names hop 2's entity by its title with the disambiguation, which the gold subquery lacks: the gold
    # subquery is judged unsound, so corruptions in its place are no contrast and are dropped (and counted)
    city = Question(id="q4", question="On which continent is the country of Grethmouth?", golden_answers=["Ardia"],
                    metadata={"decomposition": [
                        {"question": "Which country is Grethmouth in?", "answer": "Kest", "doc_id": "d5",
                         "title": "Grethmouth"},
                        {"question": "Which continent is Kest on?", "answer": "Ardia", "doc_id": "d6",
                         "title": "Kest (country)"}]})
    d5 = Document.from_parts("d5", "Grethmouth", "Grethmouth is a city in Kest, on the river Vynisk.")
    d6 = Document.from_parts("d6", "Kest (country)", "Kest is a country in Ardia.")
    questions = [Q, city]
    trajectories = [RICH, agent_steps(city, {}, {"d5": d5, "d6": d6}, topk=1)]
    assert not judge_step(city, trajectories[1][:2], trajectories[1][2]).sound
    cases, dropped = validation_cases(questions, trajectories, seed=3)
    for c in cases:
        q = questions[[x.id for x in questions].index(c.question_id)]
        _check_contrast(q, c, trajectories[questions.index(q)])
    assert dropped["redundant_search"] == dropped["premature_answer"] == 1
    assert not any(c.question_id == "q4" and c.position == 2 for c in cases)
    assert {c.kind for c in cases if c.question_id == "q1"} == set(FAMILIES)
    # the in-distribution cases are corrupt()'s with the same seed, whichever held-out families come along
    entities = ["Grethmouth", "Mai Brewery"]
    answers = ["Ardia", "Edraand", "Kest", "Tova Lunn"]
    rng = random.Random(3)
    expected = [(c.question_id, c.kind, c.position, c.corrupted) for q, s in zip(questions, trajectories)
                for c in corrupt(q, s, rng, entities, answers)]
    for families in (FAMILIES, CORRUPTIONS):
        got, _ = validation_cases(questions, trajectories, seed=3, families=families)
        inside = [(c.question_id, c.kind, c.position, c.corrupted) for c in got if c.kind in CORRUPTIONS]
        assert inside == [e for e in expected if not (e[0] == "q4" and e[2] == 2)]
    with pytest.raises(InvalidArgument, match="one correct trajectory per question"):
        validation_cases(questions, trajectories[:1])
    with pytest.raises(InvalidArgument, match="unknown corruption families"):
        validation_cases(questions, trajectories, families=["typo"])


# ---------------------------------------------------------------- the gate
def _report(overall=0.95, **aucs):
    by_kind = {"swapped_entity": {"auc": 1.0, "n": 50}, "unsupported_subanswer": {"auc": 0.9, "n": 50},
               "in_document_distractor": {"auc": 0.85, "n": 50}, "skipped_hop": {"auc": 0.97, "n": 40}}
    for kind, v in aucs.items():
        by_kind[kind] = v
    return {"overall": overall, "n": sum(v["n"] for v in by_kind.values() if v), "by_kind":
            {k: v for k, v in by_kind.items() if v}}


def test_the_gate_passes_a_prm_that_clears_every_bar():
    assert prm_gate(_report()) == (True, [])
    # the bars are inclusive
    assert prm_gate(_report(overall=0.9, unsupported_subanswer={"auc": 0.8, "n": 20}))[0]


@pytest.mark.parametrize("report, needle", [
    (_report(unsupported_subanswer={"auc": 0.51, "n": 50}), "unsupported_subanswer AUC 0.510 < 0.8"),
    (_report(in_document_distractor={"auc": 0.6, "n": 50}), "in_document_distractor AUC 0.600 < 0.8"),
    (_report(overall=0.89), "overall AUC 0.890 < 0.9"),
    (_report(in_document_distractor=None), "no in_document_distractor cases"),
    (_report(unsupported_subanswer={"auc": 1.0, "n": 5}), "5 cases, fewer than 20"),
    (_report(in_document_distractor=None, skipped_hop=None), "no held-out family was validated"),
])
def test_the_gate_fails_each_way_and_says_why(report, needle):
    passed, reasons = prm_gate(report)
    assert not passed and any(needle in r for r in reasons), reasons


def test_the_gate_reads_its_thresholds_and_refuses_what_is_not_a_report():
    assert not prm_gate(_report(), min_overall=0.96)[0]
    assert prm_gate(_report(unsupported_subanswer={"auc": 0.7, "n": 50}), min_unsupported=0.7)[0]
    with pytest.raises(InvalidArgument, match="in \\[0, 1\\]"):
        prm_gate(_report(), min_overall=90)
    with pytest.raises(InvalidArgument, match="auc_by_kind"):
        prm_gate({"auc": 0.9})


def test_centring_per_kind_moves_only_what_compares_two_kinds():
    from prorag.algorithms.prm import auc
    from prorag.prm.evaluation import centred_per_kind

    def case(kind, gold_kind, bad_kind):
        return ProbeCase("q", "Q?", kind, 1, [], Step(gold_kind, content="a"), Step(bad_kind, content="b"))

    # subqueries score low, answers high: raw, every early answer beats its subquery; within a kind the order holds
    cases = [case("premature_answer", "subquery", "answer")] * 2 + [case("swapped_entity", "subquery", "subquery")] * 2
    gold, bad = [-2.0, -1.0, -1.5, -2.5], [1.0, 0.5, -3.0, -2.8]
    g, b, means = centred_per_kind(cases, gold, bad)
    assert means == {"subquery": pytest.approx((-2.0 - 1.0 - 1.5 - 2.5 - 3.0 - 2.8) / 6), "answer": 0.75}
    assert auc(gold[:2], bad[:2]) == 0.0 and auc(g[:2], b[:2]) == 0.75  # mostly the offset: 3 of 4 orders flip
    assert auc(g[2:], b[2:]) == auc(gold[2:], bad[2:]) == 1.0
    assert [round(x - y, 9) for x, y in zip(gold, g)][2:] == [round(means["subquery"], 9)] * 2
    with pytest.raises(ValueError, match="one gold and one corrupted"):
        centred_per_kind(cases, gold, bad[:3])
