"""`prorag data import` on small files in each dataset's real schema (MuSiQue's JSONL and FlashRAG's copy,
2WikiMultiHopQA's and HotpotQA's JSON arrays) over a small wiki-18 style corpus (tests/data/fixtures/imports):
parsing, alignment through the retriever's real BM25 index, the report, the HotpotQA teacher over a real
OpenAI-compatible endpoint (the policy service's, writing scripted replies in place of a paid model), and an
SFT job built from an import."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prorag.data.imports import (Alignment, ImportConfig, Passage, align_passages, check_teacher_decomposition,
                                 import_records, index_titles, parse_record, parse_teacher_reply, read_records,
                                 relation_question, text_overlap, title_key)
from prorag.data.loaders import iter_corpus, load_questions
from prorag.errors import InvalidArgument
from tests.helpers import env

FIX = Path(__file__).parent / "fixtures" / "imports"
CORPUS = FIX / "corpus.jsonl"


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
    """The retriever's BM25 index over the fixture corpus, as `prorag index` builds it."""
    from services.retriever.docstore import DocStore
    from services.retriever.engine import BM25Retriever
    from services.retriever.indexing import build_all

    root = tmp_path_factory.mktemp("bm25")
    build_all(CORPUS, root, dense=False)
    store = DocStore(root / "docstore")
    yield BM25Retriever(root / "bm25", store)
    store.close()


def titled_for(records):
    wanted = {title_key(p.title) for r in records for p in r.supporting}
    wanted |= {title_key(h.support.title) for r in records for h in r.hops or () if h.support}
    return index_titles(iter_corpus(CORPUS), wanted)


# ----------------------------------------------------------------------------- parsing

def test_musique_hops_name_earlier_answers_and_relations_become_questions():
    recs = list(read_records(FIX / "musique.jsonl", "musique"))
    assert [r.id for r in recs] == ["2hop__101_102", "3hop1__201_202_203", "2hop__301_302", "2hop__401_402"]
    first = recs[0]
    assert [h.question for h in first.hops] == ["Who is the performer of Green Fields?",
                                                "Who is the spouse of Lena Marsh?"]
    assert first.answers == ("Tom Hale", "Thomas Hale") and first.hops[-1].answer_aliases == ("Tom Hale", "Thomas Hale")
    assert [h.support.title for h in first.hops] == ["Green Fields", "Lena Marsh"]  # the distractor is no support
    assert [h.question for h in recs[1].hops][1:] == ["Where was Ada Quill born?", "What is the country of Port Verin?"]
    assert (first.type, first.source_type, recs[1].source_type) == ("compositional", "2hop", "3hop")
    assert recs[3].answerable is False


def test_flashrag_layout_reads_like_the_original():
    # FlashRAG's MuSiQue: golden_answers, the rest under metadata, no "paragraphs": each step carries its own
    original = json.loads((FIX / "musique.jsonl").read_text().splitlines()[0])
    paragraphs = {p["idx"]: p for p in original["paragraphs"]}
    flashrag = {"id": original["id"], "question": original["question"],
                "golden_answers": [original["answer"], *original["answer_aliases"]],
                "metadata": {"answerable": True, "question_decomposition": [
                    {**s, "support_paragraph": paragraphs[s["paragraph_support_idx"]]}
                    for s in original["question_decomposition"]]}}
    a, b = parse_record(original, "musique", "a"), parse_record(flashrag, "musique", "b")
    assert (a.hops, a.answers, a.supporting) == (b.hops, b.answers, b.supporting)
    recs = list(read_records(FIX / "musique_flashrag.jsonl", "musique"))
    assert [h.question for h in recs[0].hops] == ["Which label released Green Fields?", "Who founded Harbor Records?"]
    # FlashRAG's 2Wiki: context, supporting facts and evidences as dicts of lists
    row = json.loads((FIX / "2wiki.json").read_text())[0]
    flat = {"id": row["_id"], "question": row["question"], "golden_answers": [row["answer"]], "metadata": {
        "type": row["type"],
        "context": {"title": [t for t, _ in row["context"]], "content": [c for _, c in row["context"]]},
        "supporting_facts": {"title": [t for t, _ in row["supporting_facts"]],
                             "sent_id": [i for _, i in row["supporting_facts"]]},
        "evidences": {"fact": [e[0] for e in row["evidences"]], "relation": [e[1] for e in row["evidences"]],
                      "entity": [e[2] for e in row["evidences"]]}}}
    a, b = parse_record(row, "2wiki", "a"), parse_record(flat, "2wiki", "b")
    assert (a.id, a.hops, a.answers, a.supporting, a.type) == (b.id, b.hops, b.answers, b.supporting, b.type)


def test_two_wiki_evidences_are_hops_and_comparisons_keep_their_type():
    recs = list(read_records(FIX / "2wiki.json", "2wiki"))
    comp, cmp_, inf = recs
    assert [h.question for h in comp.hops] == ["Who is the director of Night Harbor?",
                                               "Who is the father of Ada Quill?"]
    assert [h.support.title for h in comp.hops] == ["Night Harbor", "Ada Quill"]
    assert (cmp_.type, [h.question for h in cmp_.hops]) == ("comparison", ["When was Night Harbor published?",
                                                                           "When was Silver Coast published?"])
    assert (inf.type, inf.source_type) == ("compositional", "inference")  # the answer is the last hop's
    assert relation_question("Jaws", "date of birth") == "When was Jaws born?"


def test_hotpotqa_has_supporting_paragraphs_and_no_decomposition():
    recs = list(read_records(FIX / "hotpotqa.json", "hotpotqa"))
    assert all(r.hops is None for r in recs)
    assert [p.title for p in recs[0].supporting] == ["Silver Coast", "Emil Dray"]
    assert recs[0].supporting[0].text.startswith("Silver Coast is a 1958 adventure film directed by Emil Dray.")
    assert [r.type for r in recs] == ["compositional", "comparison", "compositional"]
    # the Hugging Face layout of context and supporting facts (dicts of lists) reads the same
    row = json.loads((FIX / "hotpotqa.json").read_text())[0]
    hf = {**row, "supporting_facts": {"title": [t for t, _ in row["supporting_facts"]],
                                      "sent_id": [i for _, i in row["supporting_facts"]]},
          "context": {"title": [t for t, _ in row["context"]], "sentences": [s for _, s in row["context"]]}}
    assert parse_record(hf, "hotpotqa").supporting == recs[0].supporting


def test_bad_input_is_refused_naming_the_file_and_line(tmp_path):
    with pytest.raises(InvalidArgument, match="unknown dataset 'nq'"):
        list(read_records(FIX / "musique.jsonl", "nq"))
    bad = tmp_path / "bad.jsonl"
    good = (FIX / "musique.jsonl").read_text().splitlines()[0]
    bad.write_text(good + "\n\n{not json\n")
    with pytest.raises(InvalidArgument, match=rf"{bad}:3: not valid JSON"):
        list(read_records(bad, "musique"))
    row = json.loads(good)
    del row["question_decomposition"]
    bad.write_text(good + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InvalidArgument, match=rf"{bad}:2: musique record's 'question_decomposition' must be a list"):
        list(read_records(bad, "musique"))
    rows = json.loads((FIX / "2wiki.json").read_text())
    rows[1]["evidences"] = [["Night Harbor", "publication date"]]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(json.dumps(rows))
    with pytest.raises(InvalidArgument, match=rf"{bad_json}: record 2: 2wiki 'evidences'"):
        list(read_records(bad_json, "2wiki"))
    rows = json.loads((FIX / "hotpotqa.json").read_text())
    rows[0]["supporting_facts"].append(["Nowhere", 0])
    bad_json.write_text(json.dumps(rows))
    with pytest.raises(InvalidArgument, match=r"record 1: hotpotqa supporting fact titles \['Nowhere'\]"):
        list(read_records(bad_json, "hotpotqa"))


# ----------------------------------------------------------------------------- alignment

def test_alignment_by_title_then_by_bm25_text(bm25):
    lena_personal = Passage("Lena Marsh", "Lena Marsh married the record producer Tom Hale in 1975. The couple lived "
                                          "on a farm near Ostby and raised two daughters.")
    lena_other = Passage("Lena Marsh", "Lena Marsh won a national award for a children's album recorded in winter.")
    night = Passage("Night Harbor", "Night Harbor is a 1961 crime drama directed by Ada Quill, set in a fishing port, "
                                    "about a customs officer who uncovers a smuggling ring.")
    green = Passage("Green Fields", "A folk song.")
    omar = Passage("Omar Tesk", "Omar Tesk (born 1950) is a poet and essayist. His father was the merchant Iven Tesk.")
    passages = [lena_personal, lena_other, night, green, omar]
    got = align_passages(passages, index_titles(iter_corpus(CORPUS), {title_key(p.title) for p in passages}),
                         bm25.search)
    # the one passage titled "Green Fields": its text is not even read
    assert got[green] == Alignment("c01", "title", title="Green Fields", text=got[green].text)
    # two passages carry "Lena Marsh" (one article cut in two): BM25 over the paragraph picks the right one
    assert (got[lena_personal].doc_id, got[lena_personal].by) == ("c03", "text")
    # no corpus passage is titled "Night Harbor" (the corpus says "Night Harbor (film)"): its text finds it
    assert (got[night].doc_id, got[night].by, got[night].title) == ("c05", "text", "Night Harbor (film)")
    # a related passage ("Iven Tesk", sharing many words) is not taken for a missing one
    assert got[omar].doc_id == "" and "no corpus passage is titled 'Omar Tesk'" in got[omar].reason
    assert got[lena_other].doc_id == "" and ("none of the corpus's 2 passages titled 'Lena Marsh'"
                                             in got[lena_other].reason)
    assert text_overlap(omar.text, "Iven Tesk was a merchant of the Duchy of Arn. His father was the shipowner "
                                   "Dorn Tesk.") < 0.5 <= text_overlap(night.text, bm25.docstore.get(4).text)


def test_unaligned_hops_leave_the_question_without_a_decomposition(bm25):
    recs = list(read_records(FIX / "musique.jsonl", "musique"))
    rows, rep = import_records(recs, titled_for(recs), bm25.search, ImportConfig(dataset="musique"))
    assert [r["id"] for r in rows] == ["2hop__101_102", "3hop1__201_202_203", "2hop__301_302"]  # unanswerable skipped
    first, second, third = (r["metadata"] for r in rows)
    assert [(s["doc_id"], s["question"]) for s in first["decomposition"]] == [
        ("c01", "Who is the performer of Green Fields?"), ("c03", "Who is the spouse of Lena Marsh?")]
    assert [s["doc_id"] for s in second["decomposition"]] == ["c05", "c06", "c07"]
    assert second["decomposition"][0]["title"] == "Night Harbor (film)"  # the corpus's title, as the retriever shows it
    assert third["decomposition"] == [] and [a["aligned_by"] for a in third["alignment"]] == ["", "title"]
    assert "Omar Tesk" in third["alignment"][0]["reason"]
    assert (rep["hops"], rep["hops_aligned_by_title"], rep["hops_aligned_by_text"],
            rep["hops_unaligned"]) == (7, 4, 2, 1)
    assert (rep["alignment_rate"], rep["questions_with_decomposition"], rep["skipped_unanswerable"]) == (0.8571, 2, 1)
    assert rep["questions_without"] == {"unaligned_hop": 1, "no_decomposition": 0, "teacher_rejected": 0}
    assert rep["unaligned_examples"][0]["id"] == "2hop__301_302"


# ----------------------------------------------------------------------------- the command

def _import(capsys, dataset: str, path: Path, data: Path, *extra: str) -> tuple[dict, list, str]:
    from prorag_app.cli import main

    out = data / "imports" / f"{path.stem}.jsonl"
    assert main(["data", "import", dataset, str(path), "--corpus", str(CORPUS), "--out", str(out), "--json",
                 *extra]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads(printed[-1])
    assert report == json.loads(out.with_name(f"{path.stem}.report.json").read_text())  # written beside the output
    return report, load_questions(out), "\n".join(printed[:-1])


@pytest.mark.parametrize("dataset,file,rate,full,hops", [
    ("musique", "musique.jsonl", 0.8571, 2, (7, 4, 2, 1)),
    ("musique", "musique_flashrag.jsonl", 0.75, 1, (4, 2, 1, 1)),
    ("2wiki", "2wiki.json", 0.8333, 2, (6, 3, 2, 1)),
    ("hotpotqa", "hotpotqa.json", 0.8333, 0, (0, 0, 0, 0)),
])
def test_import_prints_the_alignment_rate_and_writes_questions_sft_reads(capsys, tmp_path, dataset, file, rate, full,
                                                                         hops):
    with env("PRORAG_DATA", str(tmp_path / "data")):
        report, questions, printed = _import(capsys, dataset, FIX / file, tmp_path / "data")
    assert f"alignment rate {rate:.1%}" in printed and f"{full} questions with a full decomposition" in printed
    assert (report["alignment_rate"], report["questions_with_decomposition"]) == (rate, full)
    assert (report["hops"], report["hops_aligned_by_title"], report["hops_aligned_by_text"],
            report["hops_unaligned"]) == hops
    # what SFT's agent mode reads: a question trains when a hop of its decomposition names a corpus passage
    trained = [q for q in questions if any(s.doc_id for s in q.decomposition)]
    assert len(trained) == full
    ids = {d.id for d in iter_corpus(CORPUS)}
    assert all(s.doc_id in ids for q in trained for s in q.decomposition if s.doc_id)
    assert all(q.decomposition == [] for q in questions if q not in trained)  # never a partial one
    if dataset == "2wiki":
        cmp_ = next(q for q in questions if q.qtype == "comparison")
        assert [s.needs_retrieval for s in cmp_.decomposition] == [True, True, False]  # then compare
        assert cmp_.hops == 2  # retrieval hops
    if dataset == "hotpotqa":
        assert report["alignment_rate_of"] == "supporting_passages"
        assert "no decomposition in the dataset" in printed


def test_import_builds_its_index_where_asked_and_refuses_another_corpus(capsys, tmp_path):
    from prorag_app.cli import main

    with env("PRORAG_DATA", str(tmp_path / "data")):
        assert main(["data", "import", "musique", str(FIX / "musique.jsonl")]) == 2
        assert "--corpus" in capsys.readouterr().err
        root = tmp_path / "indexes" / "wiki"
        assert main(["data", "import", "musique", str(FIX / "musique.jsonl"), "--index-root", str(root)]) == 2
        assert "give the corpus too" in capsys.readouterr().err
        # the doc store and BM25 index `prorag index` and the setup would build there, built by the import
        assert main(["data", "import", "musique", str(FIX / "musique.jsonl"), "--corpus", str(CORPUS),
                     "--index-root", str(root), "--out", str(tmp_path / "a.jsonl")]) == 0
        assert (root / "bm25" / "meta.json").is_file() and (root / "docstore" / "meta.json").is_file()
        assert "alignment rate 85.7%" in capsys.readouterr().out
        # the index root alone names its corpus
        assert main(["data", "import", "musique", str(FIX / "musique.jsonl"), "--index-root", str(root),
                     "--out", str(tmp_path / "b.jsonl")]) == 0
        assert "alignment rate 85.7%" in capsys.readouterr().out
        assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
        other = tmp_path / "other.jsonl"
        other.write_text(CORPUS.read_text() + json.dumps({"id": "x1", "contents": '"X"\nanother passage'}) + "\n")
        assert main(["data", "import", "musique", str(FIX / "musique.jsonl"), "--corpus", str(other),
                     "--index-root", str(root)]) == 2
        assert "is not the corpus of" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the teacher

def test_teacher_reply_parsing_and_checks(bm25):
    steps, answer = parse_teacher_reply('Here: {"steps": [{"question": "Who directed Silver Coast?", "answer": '
                                        '"Emil Dray"}, {"question": "Where was Emil Dray born?", "answer": '
                                        '"Port Verin"}], "answer": "Port Verin"} done')
    assert answer == "Port Verin" and steps[0] == ("Who directed Silver Coast?", "Emil Dray")
    for bad in ("no json", '{"steps": [], "answer": "x"}', '{"steps": [{"question": "q"}], "answer": "x"}'):
        with pytest.raises(ValueError):
            parse_teacher_reply(bad)
    rec = list(read_records(FIX / "hotpotqa.json", "hotpotqa"))[0]
    hops, ids = check_teacher_decomposition(rec, steps, answer, ["c08", "c09"], bm25.search, topk=5)
    assert ids == ["c08", "c09"] and hops[-1].answer_aliases == ("Port Verin",)
    assert "matches no golden answer" in check_teacher_decomposition(rec, steps, "Ostby", ["c08", "c09"],
                                                                     bm25.search, 5)
    one = [("Who directed Silver Coast?", "Emil Dray")]
    assert "retrieve 1 of the 2" in check_teacher_decomposition(rec, one, answer, ["c08", "c09"], bm25.search, 5)
    off = [("What song did Northlights release in 1980?", "Blue Rivers")] + steps[1:]
    assert "sub-question 1" in check_teacher_decomposition(rec, off, answer, ["c08", "c09"], bm25.search, 1)


def test_a_failing_or_rambling_teacher_costs_its_questions_not_the_import(bm25):
    recs = list(read_records(FIX / "hotpotqa.json", "hotpotqa"))

    def down(messages):
        raise ConnectionError("endpoint down")

    for teacher, counter in ((down, "failed_calls"),
                             (lambda messages: "I would search for the director.", "unparsable")):
        rows, rep = import_records(recs, titled_for(recs), bm25.search, ImportConfig(dataset="hotpotqa"), teacher)
        assert len(rows) == 3 and all(r["metadata"]["decomposition"] == [] for r in rows)
        assert (rep["teacher"]["asked"], rep["teacher"][counter],
                rep["teacher"]["skipped_unaligned_support"]) == (2, 2, 1)
        assert rep["questions_without"] == {"unaligned_hop": 0, "no_decomposition": 1, "teacher_rejected": 2}


GOOD_REPLY = json.dumps({"steps": [{"question": "Who directed Silver Coast?", "answer": "Emil Dray"},
                                   {"question": "Where was Emil Dray born?", "answer": "Port Verin"}],
                         "answer": "Port Verin"})
# the comparison question answered wrongly: rejected
WRONG_REPLY = json.dumps({"steps": [{"question": "What is Lena Marsh's occupation?", "answer": "singer"},
                                    {"question": "What is Ada Quill's occupation?", "answer": "film director"}],
                          "answer": "yes"})


@pytest.fixture(scope="module")
def teacher_endpoint(tiny_policy):
    """The policy service's OpenAI-compatible endpoint on loopback, its engine writing the reply a teacher model
    would for the question in the prompt (a tiny random model cannot decompose questions)."""
    from prorag.engine import GeneratedSeq, GenerationEngine
    from prorag.rpc.service import ServeConfig
    from services.policy.server import PolicyConfig, start as start_policy
    from tests.helpers import LoopThread

    model_dir, tok = tiny_policy

    class TeacherEngine(GenerationEngine):
        name = "teacher"

        def __init__(self):
            self.tokenizer, self.max_model_len, self.calls = tok, 4096, 0

        def generate(self, prompts, params, adapter=None, seeds=None):
            out = []
            for p in prompts:
                self.calls += 1
                text = tok.decode(list(p))
                reply = GOOD_REPLY if "Silver Coast was born" in text else WRONG_REPLY
                ids = tok.encode(reply, add_special_tokens=False)
                out.append([GeneratedSeq(list(ids), [-0.1] * len(ids), "stop", None)] * params.n)
            return out

        def load_adapter(self, key, path): ...
        def unload_adapter(self, key): ...
        def adapters(self): return []
        def info(self): return {"engine": self.name}

    engine = TeacherEngine()
    loop = LoopThread()
    pol = loop.run(start_policy(ServeConfig(port=0, http_port=0), PolicyConfig(model=str(model_dir), world="tiny"),
                                engine=engine))
    yield f"http://127.0.0.1:{pol.http_port}/v1", engine
    loop.run(pol.stop())
    loop.close()


def test_teacher_decompositions_are_kept_only_when_checked(capsys, tmp_path, teacher_endpoint):
    url, engine = teacher_endpoint
    with env("PRORAG_DATA", str(tmp_path / "data")), env("OPENAI_API_KEY", "unused"):
        before = engine.calls
        report, questions, printed = _import(capsys, "hotpotqa", FIX / "hotpotqa.json", tmp_path / "data",
                                             "--teacher-url", url, "--teacher-model", "teacher")
        # the third question's "Omar Tesk" is in no corpus passage: nothing to check a teacher against, no call
        assert engine.calls == before + 2
        assert report["teacher"] == {"asked": 2, "kept": 1, "hops": 2, "failed_calls": 0, "unparsable": 0,
                                     "rejected": 1, "skipped_unaligned_support": 1}
        assert "matches no golden answer" in report["teacher_rejections"][0]["reason"]
        assert report["questions_without"] == {"unaligned_hop": 0, "no_decomposition": 1, "teacher_rejected": 1}
        assert "teacher: 2 asked, 1 kept, 1 rejected" in printed
        kept = questions[0]
        assert [(s.question, s.doc_id) for s in kept.decomposition] == [("Who directed Silver Coast?", "c08"),
                                                                        ("Where was Emil Dray born?", "c09")]
        assert kept.metadata["decomposition_source"] == "teacher"
        assert [q.decomposition for q in questions[1:]] == [[], []]
        # a second import asks nothing: every reply is cached on disk
        _import(capsys, "hotpotqa", FIX / "hotpotqa.json", tmp_path / "data", "--teacher-url", url,
                "--teacher-model", "teacher")
        assert engine.calls == before + 2


# ----------------------------------------------------------------------------- SFT from an import

def test_an_sft_job_trains_on_an_import_and_reports_its_samples(capsys, tmp_path, tiny_policy):
    """The import's questions through SFT's agent mode: documents from a retriever service over the same corpus,
    the question whose hop did not align dropped as one without a decomposition, the sample count reported."""
    from prorag.rpc.service import ServeConfig
    from services.retriever.server import RetrieverConfig, start
    from services.trainer.launch import run_stage
    from tests.helpers import LoopThread

    base = tmp_path / "home"
    with env("PRORAG_HOME", str(base)), env("PRORAG_DATA", str(base / "data")):
        model = base / "base-model"
        shutil.copytree(tiny_policy[0], model)
        _import(capsys, "musique", FIX / "musique.jsonl", base / "data")
        loop = LoopThread()
        started = loop.run(start(ServeConfig(port=0, http_port=-1),
                                 RetrieverConfig(index_root=str(base / "data" / "indexes" / "import-corpus"),
                                                 default_index="bm25")))
        try:
            out = run_stage("sft", {"mode": "agent", "questions": str(base / "data" / "imports" / "musique.jsonl"),
                                    "retriever": f"127.0.0.1:{started.grpc_port}", "base_model": str(model),
                                    "topk": 2, "max_steps": 1, "batch_size": 2, "tracking": "local", "threads": 1,
                                    "device": "cpu", "world": "imported"}, base / "work", None)
        finally:
            loop.run(started.stop())
            loop.close()
    assert out["data_questions"] == 3 and out["data_dropped_no_decomposition"] == 1
    assert out["data_samples"] == 2 and out["data_dropped_too_long"] == 0
    # one sample per question; per step (ProRAG's unit): 2 and 3 hops, a subquery and a subanswer each, an answer
    assert out["data_context_action_pairs"] == (2 * 2 + 1) + (2 * 3 + 1)
    assert out["steps"] == 1 and out["model"].startswith("sft@")
