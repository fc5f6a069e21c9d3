"""Copy task and reading curriculum for the embedded base (pure functions)."""

import random
from types import SimpleNamespace

from prorag.data.loaders import SubStep
from prorag.data.warmup import (Fact, answer_pools, copy_batch, counterfactual_swap, facts_by_doc,
                                 facts_from_questions, paraphrase_example, paraphrase_groups, reading_example,
                                 relation_key, retrieved_reading_example, sentences)

DOC = "Mai Brewery is a brewery in Porkburg. It was founded by Rasho Dry. The brewery opened in 1901."
FACTS = [Fact("O1", "Who founded Mai Brewery?", "Rasho Dry"), Fact("O1", "When did Mai Brewery open?", "1901")]


def test_facts_are_distinct_hops_with_documents():
    q1 = SimpleNamespace(decomposition=[SubStep("Who founded Mai Brewery?", "Rasho Dry", doc_id="O1"),
                                        SubStep("Is 1 > 2?", "no")])  # a comparison step has no document
    q2 = SimpleNamespace(decomposition=[SubStep("Who founded Mai Brewery?", "Rasho Dry", doc_id="O1")])
    assert facts_from_questions([q1, q2]) == [Fact("O1", "Who founded Mai Brewery?", "Rasho Dry")]
    assert facts_by_doc(FACTS + [Fact("X9", "q", "a")], {"O1": DOC}) == {"O1": FACTS}


def test_sentences():
    assert sentences(DOC) == ["Mai Brewery is a brewery in Porkburg.", "It was founded by Rasho Dry.",
                              "The brewery opened in 1901."]


def test_copy_batch_repeats_each_string():
    rows = copy_batch(random.Random(0), batch=3, length=5, low=10, high=20)
    assert len(rows) == 3 and all(r[:5] == r[5:] and all(10 <= t < 20 for t in r) for r in rows)


def test_one_sentence_passage_holds_the_answer_and_only_answers_are_trained():
    for seed in range(20):
        segs = reading_example(random.Random(seed), DOC, FACTS, n_sentences=1)
        passage, question, answer, end = segs
        assert not passage[1] and not question[1] and answer[1] and not end[1]
        assert answer[0].strip() in passage[0] and passage[0].count(".") == 1
        assert question[0].startswith("Question: ") and question[0].endswith("\nAnswer:")


def test_sentence_count_grows_and_whole_document_asks_every_fact():
    segs = reading_example(random.Random(0), DOC, FACTS, n_sentences=2)
    assert segs[0][0].count(".") == 2
    whole = reading_example(random.Random(0), DOC, FACTS, n_sentences=None)
    assert whole[0][0] == DOC + "\n"
    assert sorted(t.strip() for t, trained in whole if trained) == ["1901", "Rasho Dry"]


def test_answer_missing_from_text_gives_none():
    assert reading_example(random.Random(0), DOC, [Fact("O1", "Who?", "Nobody")], n_sentences=1) is None


def test_retrieved_reading_renders_every_document_as_a_result_and_asks_about_the_first():
    docs = {"a": '"Mai Brewery"\nMai Brewery was founded by Rasho Dry.',
            "b": '"Open Tower"\nOpen Tower was produced by Lelbeld Lines.',
            "c": '"Hymn of Byge"\nHymn of Byge was released in 1939.'}
    facts = [Fact("a", "Who founded Mai Brewery?", "Rasho Dry")]
    segs = retrieved_reading_example(random.Random(0), "a", docs, facts, ["b", "c"])
    rendered = segs[0][0]
    assert rendered.count("Doc ") == 3 and rendered.startswith("Doc 1(Title: ")
    for title in ("Mai Brewery", "Open Tower", "Hymn of Byge"):
        assert f"(Title: {title}) {title} was" in rendered
    assert [s for s, trained in segs if trained] == [" Rasho Dry"]
    assert segs[1] == ("Question: Who founded Mai Brewery?\nAnswer:", False)


def test_retrieved_reading_as_a_chat_turn_trains_only_the_answer_and_end_of_turn():
    docs = {"a": '"Mai Brewery"\nMai Brewery was founded by Rasho Dry.', "b": '"Open Tower"\nOpen Tower is a film.'}
    facts = [Fact("a", "Who founded Mai Brewery?", "Rasho Dry")]
    (prompt, trained_prompt), (answer, trained_answer) = retrieved_reading_example(
        random.Random(0), "a", docs, facts, ["b"], chat=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "Documents:\nDoc 1(Title: " in prompt and "\n\nQuestion: Who founded Mai Brewery?<|im_end|>" in prompt
    assert (trained_prompt, answer, trained_answer) == (False, "Rasho Dry<|im_end|>", True)


def test_relation_key_and_answer_pools_group_answers_by_relation():
    docs = {"O1": '"Mai Brewery"\n' + DOC, "O2": '"Open Tower"\nOpen Tower was founded by Lelbeld Lines.'}
    facts = FACTS + [Fact("O2", "Who founded Open Tower?", "Lelbeld Lines"), Fact("O9", "Who founded Gone?", "Nobody")]
    assert relation_key("Who founded Mai Brewery?", "Mai Brewery") == "Who founded X?"
    assert answer_pools(facts, docs) == {"Who founded X?": ["Lelbeld Lines", "Rasho Dry"],
                                         "When did X open?": ["1901"]}


def test_counterfactual_swap_replaces_each_answer_in_text_and_facts_consistently():
    facts = FACTS + [Fact("O1", "Who was the founder of Mai Brewery?", "Rasho Dry")]
    pools = {"Who founded X?": ["Rasho Dry", "Lelbeld Lines"], "Who was the founder of X?": ["Rasho Dry"],
             "When did X open?": ["1901", "1788"]}
    text, swapped = counterfactual_swap(random.Random(0), DOC, facts, "Mai Brewery", pools)
    assert text == "Mai Brewery is a brewery in Porkburg. It was founded by Lelbeld Lines. The brewery opened in 1788."
    # the same answer gets the same substitute under every relation that asks for it
    assert [f.answer for f in swapped] == ["Lelbeld Lines", "1788", "Lelbeld Lines"]
    assert [f.question for f in swapped] == [f.question for f in facts]
    for f in swapped:
        assert f.answer in text


def test_counterfactual_swap_leaves_a_fact_without_alternatives_or_absent_from_the_text():
    facts = [Fact("O1", "Who founded Mai Brewery?", "Rasho Dry"), Fact("O1", "Who ran Mai Brewery?", "Mo Ko")]
    pools = {"Who founded X?": ["Rasho Dry"], "Who ran X?": ["Mo Ko", "Al Be"]}
    text, swapped = counterfactual_swap(random.Random(0), DOC, facts, "Mai Brewery", pools)
    assert (text, swapped) == (DOC, facts)


def test_counterfactual_swap_never_rewrites_a_substitute():
    # "1901" -> "1788" and "1788" -> ... would chain if replaced one after another
    doc = "Built in 1901 and rebuilt in 1788."
    facts = [Fact("d", "When was it built?", "1901"), Fact("d", "When was it rebuilt?", "1788")]
    pools = {"When was it built?": ["1901", "1788", "1650"], "When was it rebuilt?": ["1788", "1901", "1650"]}
    text, swapped = counterfactual_swap(random.Random(3), doc, facts, "", pools)
    built, rebuilt = swapped[0].answer, swapped[1].answer
    assert built != "1901" and rebuilt != "1788" and built != rebuilt
    assert text == f"Built in {built} and rebuilt in {rebuilt}."


def test_question_first_asks_one_question_before_the_passage_with_the_gap_before_the_answer():
    segs = reading_example(random.Random(0), DOC, FACTS, None, question_first=True, gap="x y z\n")
    (prompt, p_trained), (answer, a_trained), (end, _) = segs
    asked = next(f for f in FACTS if prompt.startswith(f"Question: {f.question}\n"))
    assert prompt == f"Question: {asked.question}\n{DOC}\nx y z\nAnswer:" and not p_trained
    assert (answer, a_trained, end) == (f" {asked.answer}", True, "\n")


def test_gap_sits_between_every_question_and_its_answer():
    segs = reading_example(random.Random(0), DOC, FACTS, None, gap="filler\n")
    questions = [s for s, trained in segs if s.startswith("Question: ")]
    assert len(questions) == 2 and all(q.endswith("?\nfiller\nAnswer:") for q in questions)
    assert sorted(s for s, trained in segs if trained) == [" 1901", " Rasho Dry"]


def test_paraphrase_groups_are_the_phrasings_of_facts_asked_more_than_one_way():
    facts = [Fact("O1", "Who founded Mai Brewery?", "Rasho Dry"), Fact("O1", "When did Mai Brewery open?", "1901"),
             Fact("O1", "Who established Mai Brewery?", "Rasho Dry"),
             Fact("O1", "Who founded Mai Brewery?", "Rasho Dry"),
             Fact("O2", "Who founded Open Tower?", "Rasho Dry")]  # same answer, other document: another fact
    assert paraphrase_groups(facts) == [["Who founded Mai Brewery?", "Who established Mai Brewery?"]]


def test_paraphrase_example_asks_one_phrasing_and_trains_another():
    phrasings = ["Who founded Mai Brewery?", "Who established Mai Brewery?", "Who was the founder of Mai Brewery?"]
    for seed in range(5):
        (asked, a_trained), (restated, r_trained), (end, e_trained) = paraphrase_example(random.Random(seed), phrasings)
        question = asked.removeprefix("Question: ").removesuffix("\nIn other words: ")
        assert question in phrasings and restated in phrasings and question != restated
        assert (a_trained, r_trained, e_trained, end) == (False, True, False, "\n")
