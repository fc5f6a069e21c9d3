"""prorag.diagnosis: solve-rate bins, the sampled tokens' entropy, wins and losses by bin, the reading, and why an
answer is wrong along its gold chain."""

import math

import pytest

from prorag.diagnosis import (ANSWER_ERRORS, SOLVE_RATE_BINS, answer_error, error_transitions, gold_chain, reading,
                              solve_rate_bin, token_entropy, wins_losses_by_bin)


def test_solve_rate_bins_split_never_rarely_often_always():
    assert [solve_rate_bin(r) for r in (0.0, 0.125, 0.5, 0.625, 0.875, 1.0)] == [
        "never", "rarely", "rarely", "often", "often", "always"]
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        solve_rate_bin(1.5)


def test_token_entropy_is_the_mean_negative_log_prob_of_the_sampled_tokens():
    # a uniform choice among 4 tokens: every sampled token has log p = -log 4, the entropy log 4
    assert token_entropy([[-math.log(4)] * 3, [-math.log(4)]]) == pytest.approx(math.log(4))
    assert token_entropy([]) == token_entropy([[]]) == 0.0


def test_wins_and_losses_are_counted_per_bin_over_questions_both_sides_answered():
    model = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.5, "e": 1.0}
    ref = {"a": 0.0, "b": 1.0, "c": 0.5, "d": 0.0}  # e: no reference answer, left out
    bins = {"a": "rarely", "b": "always", "c": "rarely", "d": "often", "e": "never"}
    out = wins_losses_by_bin(model, ref, bins)
    assert set(out) == set(SOLVE_RATE_BINS)
    assert out["rarely"] == {"n": 2, "wins": 1, "losses": 0, "ties": 1, "diff": 0.5}
    assert out["always"] == {"n": 1, "wins": 0, "losses": 1, "ties": 0, "diff": -1.0}
    assert out["never"] == {"n": 0, "wins": 0, "losses": 0, "ties": 0, "diff": 0.0}
    with pytest.raises(ValueError, match="not one of"):
        wins_losses_by_bin(model, ref, {"a": "sometimes"})


def test_the_reading_puts_unseen_questions_first():
    up, flat, down = [0.01, 0.04], [-0.01, 0.02], [-0.04, -0.01]
    assert reading(up, up, 0.0, 0.0) == "learns"
    assert reading(up, down, 0.1, -0.5) == "drifts"  # a gain on the pool does not hide a loss on new questions
    assert reading(up, flat, 0.1, -0.5) == "memorises"
    assert reading(flat, flat, 0.05, -0.2) == "sharpens"
    assert reading(flat, flat, 0.05, 0.1) == reading(flat, flat, -0.01, -0.2) == "no change"
    assert reading(None, None, 0.0, 0.0) == "no change"


# A 2-hop chain as the embedded world writes it: Ann Lee's birthplace, then that city's country.
HOPS = [{"doc_id": "P1", "title": "Ann Lee", "answer_aliases": ["Oslo"]},
        {"doc_id": "C1", "title": "Oslo", "answer_aliases": ["Norway", "Kingdom of Norway"]}]
DOCS = {"P1": "Ann Lee was born in Oslo. Ann Lee was a writer.", "C1": "Oslo is a city in Norway.",
        "P2": "Ann Leeds was born in Bergen.", "C2": "Osby is a town in Sweden."}


def search(query, doc, subanswer=None):
    steps = [{"kind": "STEP_KIND_SUBQUERY", "content": query,
              "retrieved": [{"document": {"id": doc, "text": DOCS[doc]}, "rank": 1}]}]
    if subanswer is not None:
        steps.append({"kind": "STEP_KIND_SUBANSWER", "content": subanswer})
    return steps


ANSWER = [{"kind": "STEP_KIND_ANSWER", "content": "whatever"}]
FIRST_HOP = search("Where was Ann Lee born?", "P1", "Oslo")


@pytest.mark.parametrize("steps, finish, want", [
    # the first hop: a subquery without the entity, one naming it that the retriever misses, the wrong fact of the
    # right document, a span that is not in it (here the entity itself), a trajectory that breaks off after reading
    (search("Where was Ann Leeds born?", "P2", "Bergen") + ANSWER, "answer", "subquery_entity"),
    (search("Where was Ann Lee born?", "P2", "Bergen") + ANSWER, "answer", "retrieval_miss"),
    (search("What did Ann Lee do?", "P1", "writer") + ANSWER, "answer", "wrong_fact"),
    (search("Where was Ann Lee born?", "P1", "Ann Lee") + ANSWER, "answer", "misread"),
    (search("Where was Ann Lee born?", "P1", "Olso") + ANSWER, "answer", "misread"),
    (search("Where was Ann Lee born?", "P1"), "invalid_format", "broke_format"),
    # the second hop: never searched for (an answer, or the format broken), or searched for and missed
    (FIRST_HOP + ANSWER, "answer", "early_answer"),
    (FIRST_HOP, "invalid_format", "broke_format"),
    (FIRST_HOP, "max_steps", "broke_format"),
    (FIRST_HOP + search("In which country is Osby?", "C2", "Sweden") + ANSWER, "answer", "subquery_entity"),
    # both hops resolved: the final answer is what went wrong
    (FIRST_HOP + search("In which country is Oslo?", "C1", "Kingdom of Norway") + ANSWER, "answer", "final_answer"),
])
def test_a_wrong_answer_is_read_at_the_first_hop_it_never_resolved(steps, finish, want):
    assert answer_error(steps, finish, HOPS, 0.0) == want


def test_a_right_answer_is_right_whatever_its_steps_and_a_partial_one_is_not():
    assert answer_error([], "answer", HOPS, 1.0) == "right"
    assert answer_error(FIRST_HOP + ANSWER, "answer", HOPS, 0.5) == "early_answer"


def test_a_search_that_recovers_clears_its_hop_and_the_first_failure_of_the_stuck_hop_counts():
    retry = search("Where was Ann Leeds born?", "P2", "Bergen") + FIRST_HOP  # missed, then found
    second = search("Where is Oslo?", "C1", "Oslo") + search("Where is Osby?", "C2", "Sweden")
    # hop 1 recovered, so hop 2 is where it stuck, and its first failure there (a misread) is the verdict
    assert answer_error(retry + second + ANSWER, "answer", HOPS, 0.0) == "misread"


def test_hops_without_an_order_are_resolved_in_any_order():
    # a comparison question: two entities' facts, read in the opposite order from the chain's
    hops = [{"doc_id": "P1", "title": "Ann Lee", "answer_aliases": ["writer"]},
            {"doc_id": "C1", "title": "Oslo", "answer_aliases": ["Norway"]}]
    steps = search("In which country is Oslo?", "C1", "Norway") + search("What did Ann Lee do?", "P1", "writer")
    assert answer_error(steps + ANSWER, "answer", hops, 0.0) == "final_answer"
    assert answer_error(steps[:2] + ANSWER, "answer", hops, 0.0) == "early_answer"


def test_error_transitions_count_every_pair_over_questions_both_models_answered():
    before = {"a": "right", "b": "misread", "c": "misread", "d": "wrong_fact"}
    after = {"a": "early_answer", "b": "right", "c": "misread", "e": "right"}  # d, e: one side only
    out = error_transitions(before, after)
    assert set(out) == set(ANSWER_ERRORS) and all(set(row) == set(ANSWER_ERRORS) for row in out.values())
    assert out["right"]["early_answer"] == out["misread"]["right"] == out["misread"]["misread"] == 1
    assert sum(n for row in out.values() for n in row.values()) == 3


def test_a_title_s_disambiguator_is_not_asked_for_in_the_subquery():
    hops = [{"doc_id": "C1", "title": "Oslo (city)", "answer_aliases": ["Norway"]}]
    assert answer_error(search("In which country is Oslo?", "C2", "Sweden") + ANSWER, "answer", hops, 0.0) == \
        "retrieval_miss"


def test_the_gold_chain_is_the_hops_that_read_a_document():
    comparison = {"decomposition": [{"doc_id": "P1", "title": "Ann Lee"}, {"doc_id": "P2", "title": "Bo Ek"},
                                    {"doc_id": "", "title": "", "question": "Who is older?"}]}
    assert [h["doc_id"] for h in gold_chain(comparison)] == ["P1", "P2"]
    assert gold_chain({}) == gold_chain({"decomposition": [{"question": "no document"}]}) == []
