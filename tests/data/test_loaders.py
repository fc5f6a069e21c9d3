"""Loaders: the wiki-18 contents format, FlashRAG question files of each real dataset, embedded worlds."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from prorag.config import from_dict
from prorag.data.loaders import (Document, Question, SubStep, format_contents, iter_corpus, load_corpus,
                                 load_questions, load_split, parse_contents)
from prorag.data.world import SPLITS, WorldConfig, build_world
from prorag.errors import InvalidArgument


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- contents

def test_parse_and_format_are_inverse():
    rng = random.Random(0)
    alphabet = 'ab "xé—\t\'()'
    for _ in range(500):
        title = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        text = "".join(rng.choice(alphabet + "\n") for _ in range(rng.randint(0, 30)))
        assert parse_contents(format_contents(title, text)) == (title, text)
    assert format_contents("Kessaro", "A city.") == '"Kessaro"\nA city.'


def test_parse_contents_edge_cases():
    assert parse_contents('"The "Best" Song"\nText here') == ('The "Best" Song', "Text here")
    assert parse_contents('"Title"\nline one\nline two') == ("Title", "line one\nline two")
    assert parse_contents('"Title only"') == ("Title only", "")
    assert parse_contents("Unquoted title\nbody") == ("Unquoted title", "body")  # FlashRAG: first line is the title
    assert parse_contents("just a passage") == ("", "just a passage")
    assert parse_contents('""\nno title') == ("", "no title")
    # a title with a line break cannot survive the format: it becomes one line
    assert parse_contents(format_contents("two\nlines", "t")) == ("two lines", "t")


def test_load_corpus_wiki18_and_title_text_rows(tmp_path):
    p = write_rows(tmp_path / "c.jsonl", [
        {"id": "0", "contents": '"Aaron"\nAaron is a prophet.'},
        {"id": 1, "title": "Beyoncé", "text": "Beyoncé is a singer."},  # FlashRAG/BEIR style, int id
        {"_id": "doc7", "title": "", "text": "Untitled passage.", "metadata": {}},  # BEIR
    ])
    docs = load_corpus(p)
    assert docs[0] == Document("0", "Aaron", "Aaron is a prophet.", '"Aaron"\nAaron is a prophet.')
    assert docs[1].id == "1" and docs[1].contents == '"Beyoncé"\nBeyoncé is a singer.'
    assert docs[2].id == "doc7" and docs[2].title == "" and docs[2].text == "Untitled passage."
    assert [d.to_row() for d in docs][0] == {"id": "0", "contents": '"Aaron"\nAaron is a prophet.'}


def test_load_corpus_gzip_and_errors(tmp_path):
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(json.dumps({"id": "1", "contents": '"T"\nx'}) + "\n\n")
    assert [d.title for d in iter_corpus(gz)] == ["T"]
    bad = write_rows(tmp_path / "bad.jsonl", [{"id": "1", "contents": '"T"\nx'}, {"contents": '"U"\ny'}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'id'"):
        load_corpus(bad)
    bad.write_text('{"id": "1", "foo": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*contents"):
        load_corpus(bad)
    bad.write_text('{"id": "1", "contents": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not valid JSON"):
        load_corpus(bad)


def test_document_from_row_is_the_one_row_reader():
    # the retriever's doc store reads its rows here too, so a bad row is INVALID_ARGUMENT to its callers
    assert Document.from_row({"docid": 3, "contents": "just text"}) == Document("3", "", "just text", "just text")
    for row, msg in (([1], "expected a JSON object"), ({"contents": "x"}, "no 'id'"), ({"id": "1"}, "neither")):
        with pytest.raises(InvalidArgument, match=rf"c\.jsonl:4: .*{msg}"):
            Document.from_row(row, "c.jsonl:4")


# ----------------------------------------------------------------------------- questions in each dataset's shape

NQ = {"id": "test_0", "question": "who got the first nobel prize in physics",
      "golden_answers": ["Wilhelm Conrad Röntgen", "Röntgen"]}
HOTPOTQA = {"id": "5a8b57f25542995d1e6f1371", "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
            "golden_answers": ["yes"],
            "metadata": {"type": "comparison", "level": "hard",
                         "supporting_facts": {"title": ["Scott Derrickson", "Ed Wood"], "sent_id": [0, 0]},
                         "context": {"title": ["Ed Wood", "Scott Derrickson"], "sentences": [["..."], ["..."]]}}}
TWOWIKI = {"id": "8813f87c0bdd11eba7f7acde48001122", "question": "Who is the mother of the director of film X?",
           "golden_answers": ["Some Person"],
           "metadata": {"type": "compositional", "supporting_facts": [["X", 0], ["Y", 1]],
                        "evidences": [["X", "director", "Y"], ["Y", "mother", "Some Person"]]}}
MUSIQUE = {"id": "2hop__13548_13529", "question": "When was the person who wrote X born?",
           "golden_answers": ["1931", "in 1931"],
           "metadata": {"answerable": True,
                        "paragraphs": [{"idx": 0, "title": "X", "paragraph_text": "...", "is_supporting": True},
                                       {"idx": 3, "title": "Writer", "paragraph_text": "...", "is_supporting": True}],
                        "question_decomposition": [
                            {"id": 13548, "question": "who wrote X", "answer": "Writer", "paragraph_support_idx": 0},
                            {"id": 13529, "question": "when was #1 born", "answer": "1931",
                             "paragraph_support_idx": 3}]}}
BAMBOOGLE = {"id": "test_12", "question": "Who was president when the inventor was born?",
             "golden_answers": ["John Adams"], "metadata": {}}
POPQA = {"id": 4222362, "question": "What is George Rankin's occupation?", "golden_answers": ["politician",
                                                                                              "political leader"],
         "metadata": {"subj": "George Rankin", "prop": "occupation", "obj": "politician", "s_pop": 142}}


def test_flashrag_shapes_load(tmp_path):
    p = write_rows(tmp_path / "mixed.jsonl", [NQ, HOTPOTQA, TWOWIKI, MUSIQUE, BAMBOOGLE, POPQA])
    nq, hp, tw, mu, bb, pq = load_questions(p)

    assert nq.golden_answers == ["Wilhelm Conrad Röntgen", "Röntgen"] and nq.metadata == {}
    assert nq.hops == 1 and nq.qtype == "unknown" and nq.decomposition == []

    assert hp.qtype == "comparison" and hp.hops == 2 and hp.metadata["level"] == "hard"
    assert hp.metadata["context"]["title"] == ["Ed Wood", "Scott Derrickson"]  # arbitrary metadata kept

    assert tw.qtype == "compositional" and tw.hops == 2 and tw.metadata["evidences"][0][1] == "director"

    assert mu.hops == 2
    assert mu.decomposition == [SubStep("who wrote X", "Writer", ["Writer"], "0", "X"),
                                SubStep("when was #1 born", "1931", ["1931"], "3", "Writer")]

    assert bb.metadata == {} and bb.golden_answers == ["John Adams"]
    assert pq.id == "4222362" and pq.metadata["prop"] == "occupation" and pq.supporting_doc_ids == []


def test_golden_answers_normalised_to_list_of_str(tmp_path):
    p = write_rows(tmp_path / "q.jsonl", [
        {"id": 1, "question": "q1", "golden_answers": "single"},
        {"id": 2, "question": "q2", "golden_answers": [1931, "1931", None, ""]},
        {"id": 3, "question": "q3", "golden_answers": [["a", "b"], "c"]},
        {"id": 4, "question": "q4", "answers": ["from answers"]},
        {"id": 5, "question": "q5", "golden_answers": ["x"], "metadata": None},
    ])
    qs = load_questions(p)
    assert [q.golden_answers for q in qs] == [["single"], ["1931", "1931"], ["a", "b", "c"], ["from answers"],
                                              ["x"]]
    assert [q.id for q in qs] == ["1", "2", "3", "4", "5"] and qs[4].metadata == {}
    assert load_questions(p, limit=2)[-1].id == "2"


@pytest.mark.parametrize("row,msg", [
    ({"id": "1", "golden_answers": ["a"]}, "question"),
    ({"id": "1", "question": "   ", "golden_answers": ["a"]}, "question"),
    ({"id": "1", "question": "q"}, "golden answers"),
    ({"id": "1", "question": "q", "golden_answers": []}, "golden answers"),
    ({"id": "1", "question": "q", "golden_answers": [None]}, "golden answers"),
    ({"question": "q", "golden_answers": ["a"]}, "'id'"),
])
def test_bad_question_rows_name_file_and_line(tmp_path, row, msg):
    p = write_rows(tmp_path / "q.jsonl", [NQ, row])
    with pytest.raises(ValueError, match=rf"q\.jsonl:2: .*{msg}"):
        load_questions(p)


def test_question_round_trip_and_defaults():
    q = Question.from_row({"id": "x", "question": "q?", "golden_answers": ["a"],
                           "metadata": {"type": "comparison", "hops": 2, "decomposition": [
                               {"question": "s1?", "answer": "1", "doc_id": "d1", "title": "T1"},
                               {"question": "s2?", "answer": "2", "answer_aliases": ["2", "two"], "doc_id": "d2",
                                "title": "T2"},
                               {"question": "q?", "answer": "a", "answer_aliases": ["a"], "doc_id": "", "title": ""}],
                               "chain": "c"}})
    assert q.hops == 2 and q.qtype == "comparison"
    assert q.decomposition[0].answer_aliases == ["1"]  # aliases default to the answer
    assert [s.needs_retrieval for s in q.decomposition] == [True, True, False]
    assert q.supporting_doc_ids == ["d1", "d2"]
    assert Question.from_row(q.to_row()) == q
    # hops derived from the decomposition when metadata does not say
    meta = dict(q.metadata)
    del meta["hops"]
    assert Question("y", "q", ["a"], meta).hops == 2
    assert Question("3hop1__1_2_3", "q", ["a"]).hops == 3


def test_embedded_world_loads_through_same_loaders(tmp_path):
    out = tmp_path / "w"
    summary = build_world(from_dict(WorldConfig, {"size": "tiny", "seed": 4}), out)
    docs = load_corpus(out / "corpus.jsonl")
    assert len(docs) == summary.n_docs
    for d in docs:
        assert format_contents(d.title, d.text) == d.contents
    ids = {d.id for d in docs}
    for s in SPLITS:
        qs = load_split(out, s)
        assert len(qs) == summary.splits[s]
        for q in qs:
            assert q.hops == q.metadata["hops"] and q.qtype == q.metadata["type"]
            assert set(q.supporting_doc_ids) <= ids
            assert all(isinstance(st, SubStep) for st in q.decomposition)
            assert Question.from_row(json.loads(json.dumps(q.to_row()))) == q


def test_load_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no split 'dev'"):
        load_split(tmp_path, "dev")
    write_rows(tmp_path / "dev.jsonl", [NQ])  # a FlashRAG dataset folder has no world.json: no DONE needed
    assert load_split(tmp_path, "dev")[0].id == "test_0"
    (tmp_path / "world.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_split(tmp_path, "dev")
