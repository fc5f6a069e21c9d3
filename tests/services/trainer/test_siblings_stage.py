"""The siblings stage against real retriever, policy and judge servers on loopback, on the tiny world: at each prefix
of one on-policy trajectory per question, the trajectory's step and its sampled siblings paired (invalid ones and
copies left out, one-name variants of a sub-answer kept), every pair labelled by the judge service, counts per step
kind, the PRM stage's pair format, and a stopped job resuming without sampling or judging finished questions again.

The policy server runs the MCTS test's scripted engine, made to write a malformed step or a copy of the right step
now and then (JunkyWalkEngine), since the stage must drop both; everything else is real."""

from __future__ import annotations

import pytest

from prorag.config import ConfigError, from_dict
from prorag.io import read_jsonl
from prorag.search.mcts import step_key
from prorag.search.pairs import StepPair, load_pairs
from prorag.trajectory import Step
from prorag.training.context import local_context
from tests.services.trainer.scripted_stack import journal_after_a_stop, search_stage_config, stack_fixture
from tests.services.trainer.test_mcts_stage import GoldWalkEngine


class JunkyWalkEngine(GoldWalkEngine):
    """GoldWalkEngine's steps; one in five a malformed step, one in five the gold-walk step written in capitals with
    extra punctuation (a copy of a sibling under the answer normaliser)."""

    name = "junky-walk"
    #: set by a test: at a sub-answer, read the last retrieval block (the hop's answer when it is there, else the
    #: first document's title: a name read, not the answer), so other documents make it write another name
    reads = False
    #: set by a test: a sub-answer to a subquery that is none of the question's hops names the block's last name
    #: that is not its title (what the document says about something else)
    relations = False
    #: set by a test: a subquery after a sub-answer asks the gold hop's question about the name the context last
    #: stated (the gold previous answer replaced by it), so another stated name makes it search another entity
    bridges = False

    def _next(self, q, generated: str, rng) -> str:
        hops = [h for h in q.decomposition if h.doc_id]
        hop = generated.count("</subanswer>")
        if self.relations and generated.rstrip().removesuffix("<step>").rstrip().endswith("</retrieval>"):
            import re

            asked = generated.rsplit("<subquery>\n", 1)[-1].split("</subquery>")[0]
            if all(asked != h.question for h in hops):
                block = generated.rsplit("<retrieval>", 1)[-1].split("</retrieval>")[0]
                title = block.split("(Title: ", 1)[-1].split(")", 1)[0]
                names = [n for n in re.findall(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*|\d{3,}", block.split(")", 1)[-1])
                         if n not in title and not title.startswith(n)]
                return f"The document says.</step>\n<subanswer>\n{names[-1] if names else 'Nobody'}</subanswer>"
        if self.bridges and 0 < hop < len(hops) and generated.rstrip().endswith("<step>") and \
                generated.count("</subquery>") == hop:
            stated = generated.rsplit("<subanswer>\n", 1)[-1].split("</subanswer>")[0]
            sub = hops[hop].question.replace(hops[hop - 1].answer, stated)
            return f"Next I search.</step>\n<subquery>\n{sub}</subquery>"
        if self.reads and generated.rstrip().removesuffix("<step>").rstrip().endswith("</retrieval>"):
            block = generated.rsplit("<retrieval>", 1)[-1]
            hops = [h for h in q.decomposition if h.doc_id]
            hop = hops[min(generated.count("</subanswer>"), len(hops) - 1)]
            title = block.split("(Title: ", 1)[-1].split(")", 1)[0] if "(Title: " in block else "Nobody"
            said = hop.answer if hop.answer in block else title
            return f"The document says.</step>\n<subanswer>\n{said}</subanswer>"
        step = super()._next(q, generated, rng)
        r = rng.random()
        if r < 0.2:
            return "I am not sure what to do next"  # no tags: an invalid step
        if r < 0.4:
            head, tag, rest = step.partition("</step>\n<")
            kind, _, body = rest.partition(">\n")
            content, _, close = body.partition("</")
            return f"{head}{tag}{kind}>\n{content.upper()}!!</{close}"
        return step


services = stack_fixture("siblings", JunkyWalkEngine, judge=True)


def _config(services, **kw):
    from services.trainer.stage_siblings import SiblingsStageConfig

    return search_stage_config(SiblingsStageConfig, services, **{"samples": 4, "max_steps": 6, **kw})


def test_siblings_stage_pairs_every_valid_distinct_sibling_and_the_judge_labels_them(services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    metrics = run_siblings(local_context(tmp_path / "job", _config(services), stage="siblings"))
    pairs = load_pairs(metrics["pairs_path"])  # the PRM stage's reader
    assert metrics["questions"] == 6 and metrics["pairs"] == len(pairs) > 0
    assert metrics["prefixes"] > 6  # trajectories of more than one step
    # every prefix sampled the trajectory's step and 4 siblings
    assert metrics["siblings_sampled"] == 5 * metrics["prefixes"]
    # the engine's malformed steps and copies were sampled, and dropped
    assert metrics["siblings_invalid"] > 0 and metrics["siblings_duplicate"] > 0
    for p in pairs:
        assert p.steps[0].valid and p.steps[1].valid and step_key(p.steps[0]) != step_key(p.steps[1])
        assert p.values == (0.0, 0.0) and p.visits == (0, 0) and p.value_choice is None
        assert p.meta["source"] == "siblings"
    # a pair's two siblings share a context, and a question's contexts are the prefixes of one trajectory
    by_q: dict[str, list] = {}
    for p in pairs:
        by_q.setdefault(p.question_id, []).append([step_key(s) for s in p.context])
    for contexts in by_q.values():
        longest = max(contexts, key=len)
        assert all(c == longest[:len(c)] for c in contexts)
    # no pair twice under one context
    seen = [(p.question_id, len(p.context), frozenset(map(step_key, p.steps))) for p in pairs]
    assert len(seen) == len(set(seen))
    # the reading contrast: sub-answers that differ in the name they state are both kept, and the judge tells them
    # apart (the scripted policy writes the gold hop answer or a wrong one)
    reading = [p for p in pairs if p.meta["step_kind"] == "subanswer"]
    assert reading and any(p.judge_choice is not None for p in reading)
    # the judge labelled what it could decide, counted per kind, with its reasons
    assert 0 < metrics["judge_labelled"] == sum(p.judge_choice is not None for p in pairs)
    by_kind = metrics["pairs_by_kind"]
    for kind, counts in by_kind.items():
        mine = [p for p in pairs if p.meta["step_kind"] == kind]
        assert counts["pairs"] == len(mine) and counts["value_labelled"] == 0
        assert counts["judge_labelled"] == metrics[f"pairs_by_kind.{kind}.judge_labelled"] == sum(
            p.judge_choice is not None for p in mine)
        assert sum(metrics["judge_reasons_by_kind"][kind].values()) <= len(mine)
    # the reference judge's reasons: a wrong sub-answer rejected against the gold one, or no contrast
    assert metrics["judge_reasons_by_kind"]["subanswer"].get("rejected: wrong answer", 0) > 0
    assert all(r.startswith(("rejected: ", "declined: ")) for c in metrics["judge_reasons_by_kind"].values()
               for r in c)


def test_reading_samples_pair_the_sub_answer_read_from_the_real_documents_with_ones_read_from_others(
        services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    engine = services["engine"]
    engine.reads = True
    try:
        plain = run_siblings(local_context(tmp_path / "plain", _config(services, topk=2), stage="siblings"))
        metrics = run_siblings(local_context(tmp_path / "reading", _config(services, topk=2, reading_samples=2),
                                             stage="siblings"))
    finally:
        engine.reads = False
    assert plain["reading_sampled"] == plain["reading_pairs"] == 0
    # two other document sets (the top document removed, another question's) at every prefix after a search
    assert metrics["reading_sampled"] > 0 and metrics["reading_sampled"] % 2 == 0
    pairs = load_pairs(metrics["pairs_path"])
    reading = [p for p in pairs if p.meta["source"] == "siblings-reading"]
    assert len(reading) == metrics["reading_pairs"] > 0
    assert metrics["pairs"] == len(pairs) > plain["pairs"]
    for p in reading:
        # after a search, in the real context: a sub-answer read elsewhere against the rest
        assert p.context[-1].kind == "subquery" and p.context[-1].docs
        assert "subanswer" in p.meta["step_kind"].split("|")
    # the judge prefers the name the real documents give: the chosen sub-answer is in them, the other is not the
    # hop's answer (read from documents that lack it)
    labelled = [p for p in reading if p.judge_choice is not None]
    assert len(labelled) == metrics["reading_judge_labelled"] > 0
    for p in labelled:
        chosen = p.steps[p.judge_choice]
        if chosen.kind == "subanswer":
            assert any(chosen.content in f"{d.title} {d.text}" for d in p.context[-1].docs)
    assert any("rejected: wrong answer" in r for r in reason_counts_of(reading))


@pytest.mark.parametrize("option", ["reading_samples", "bridge_samples"])
def test_decoys_on_one_question_fail_before_anything_is_sampled(services, tmp_path, one_thread, option):
    from prorag.errors import InvalidArgument
    from services.trainer.stage_siblings import run_siblings

    with pytest.raises(InvalidArgument, match="two questions"):
        run_siblings(local_context(tmp_path / "job", _config(services, max_questions=1, **{option: 2}),
                                   stage="siblings"))
    assert not (tmp_path / "job" / "checkpoints" / "siblings-journal.jsonl").exists()


def reason_counts_of(pairs) -> dict:
    from services.trainer.stage_siblings import reason_counts

    return {r: n for by_kind in reason_counts(pairs).values() for r, n in by_kind.items()}


def test_reading_contexts_drop_the_top_document_and_what_was_read_and_add_the_decoy():
    from prorag.data.loaders import Document
    from services.trainer.stage_siblings import reading_contexts, without_sentences_naming

    assert reading_contexts(["d1", "d2", "d3"], ["x1"]) == [["d2", "d3"], ["x1"]]
    assert reading_contexts(["d1"], ["x1", "x2"]) == [["x1", "x2"]]  # one document: nothing left without it
    assert reading_contexts(["d1", "d2"], []) == [["d2"]]
    d1 = Document.from_parts("d1", "Wol Pictures", "Wol Pictures makes films. It was founded by Ana Berg in 1921! "
                                                   "ANA BERG lived in Maiwa. Its studio is in Old Town.")
    d2 = Document.from_parts("d2", "Ana Berg", "Ana Berg was a director.")
    left = without_sentences_naming([d1, d2], "Ana Berg")
    # every sentence naming it goes (any case); a document with nothing left goes; ids and titles are kept
    assert [(d.id, d.title, d.text) for d in left] == [
        ("d1", "Wol Pictures", "Wol Pictures makes films. Its studio is in Old Town.")]
    assert left[0].contents.startswith('"Wol Pictures"')
    assert without_sentences_naming([d1], "Edraand") == []  # not read from these documents: no such set
    assert without_sentences_naming([d2], "Ana Berg") == []  # nothing would be left
    assert without_sentences_naming([d1], "  ") == []
    # a whole name only, however it is spaced: a longer name that starts with it is another entity
    d3 = Document.from_parts("d3", "Bergson Hall", "Ana Bergson built it. Ana  Berg sold it. It stands in Maiwa.")
    assert [d.text for d in without_sentences_naming([d3], "Ana Berg")] == ["Ana Bergson built it. It stands in Maiwa."]
    assert without_sentences_naming([d3], "Ana Ber") == []  # part of a name names nothing
    assert reading_contexts([d1], ["x1"], said="Ana Berg") == [left, ["x1"]]


def test_decoy_question_is_another_fixed_by_id_and_needs_two():
    from types import SimpleNamespace as NS

    from prorag.errors import InvalidArgument
    from services.trainer.stage_siblings import decoy_question

    qs = [NS(id=f"q{i}", question=f"Q{i}?") for i in range(5)]
    for q in qs:
        d = decoy_question(qs, q)
        assert d.id != q.id and decoy_question(list(reversed(qs)), q).id in {x.id for x in qs} - {q.id}
        assert decoy_question(qs, q) is d
    with pytest.raises(InvalidArgument, match="two questions"):
        decoy_question(qs[:1], qs[0])


def test_a_seeded_job_samples_the_same_pairs_again(services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    cfg = _config(services, max_questions=2, concurrency=2)
    a = run_siblings(local_context(tmp_path / "a", cfg, stage="siblings"))
    b = run_siblings(local_context(tmp_path / "b", cfg, stage="siblings"))
    rows = [sorted((r["question_id"], len(r["context"]), str(r["steps"])) for r in read_jsonl(m["pairs_path"]))
            for m in (a, b)]
    assert rows[0] == rows[1] and rows[0]


def test_stopped_siblings_job_resumes_without_sampling_or_judging_finished_questions(services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    cfg = _config(services, max_questions=4, concurrency=1)
    journal = journal_after_a_stop(run_siblings, cfg, tmp_path / "job", "siblings")
    assert len(journal) < 4
    # the journal holds judged pairs: a resumed job does not ask the judge again
    assert any(p["judge_choice"] is not None for r in journal for p in r["pairs"])
    first = {r["question_id"]: r["pairs"] for r in journal}
    # a kill can tear the last line: that question is sampled again
    with open(tmp_path / "job" / "checkpoints" / "siblings-journal.jsonl", "a") as f:
        f.write('{"question_id": "torn"')
    metrics = run_siblings(local_context(tmp_path / "job", cfg, stage="siblings"))
    pairs = list(read_jsonl(metrics["pairs_path"]))
    assert metrics["questions"] == 4
    for qid, rows in first.items():  # finished questions kept as they were
        assert [r for r in pairs if r["question_id"] == qid] == rows
    assert {r["question_id"] for r in pairs} - set(first)  # the unfinished ones were sampled now
    assert metrics["policy_calls"] > 0


def test_config_requires_a_judge_and_refuses_the_test_split(services):
    from services.trainer.stage_siblings import SiblingsStageConfig

    with pytest.raises(ConfigError, match="judge"):
        _config(services, judge="")
    with pytest.raises(ConfigError, match="split"):
        _config(services, split="test")
    with pytest.raises(ConfigError, match="policy_model"):
        from_dict(SiblingsStageConfig, {"judge": services["judge"]})


def test_the_trainer_knows_the_stage_and_refuses_a_bad_config():
    from prorag.errors import InvalidArgument
    from services.trainer.stages import get_stage, load_stage_modules, validate_config

    load_stage_modules()
    stage = get_stage("siblings")
    with pytest.raises(InvalidArgument, match="config.judge"):
        validate_config(stage, {"policy_model": "sft"})


class _ScriptedEnv:
    """expand/reward of services.trainer.search_env.ServiceEnv over a fixed script: at depth d, the steps of
    script[d]."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def expand(self, history, n):
        self.calls.append((len(history), n))
        return list(self.script[len(history)][:n]), 3 * n

    def reward(self, steps):
        return 1.0 if steps[-1].content == "Edraand" else 0.0

    def expand_reading(self, history, docs, n):
        self.calls.append(("reading", len(history), [d.title for d in docs], n))
        return [Step("subanswer", content=d.title) for d in docs][:n] + [Step("subquery", content="Who?")], 2 * n

    def expand_relation(self, history, asked, n):
        self.calls.append(("relation", len(history), asked, n))
        return [Step("subanswer", content="1941"), Step("subquery", content=asked)][:n], 4 * n

    def expand_bridge(self, history, name, n):
        self.calls.append(("bridge", len(history), name, n))
        return [Step("subquery", content=f"Where was {name} born?"), Step("subanswer", content=name),
                Step("subquery", content=f"where was {name.upper()} born")][:n + 1], 5 * n


def test_sample_question_pairs_the_trajectory_step_with_its_distinct_valid_siblings():
    from services.trainer.stage_siblings import sample_question

    q1, q2 = Step("subquery", content="Who founded Mai Brewery?", docs=[]), Step("subquery", content="Who is Kora?",
                                                                                 docs=[])
    a1, a2 = Step("subanswer", content="Tova Lunn"), Step("subanswer", content="Tova Lind")
    script = [
        [q1, Step("invalid", text="junk"), Step("subquery", content="who founded the mai brewery", docs=[]), q2],
        [a1, a2, Step("subanswer", content="TOVA LUNN."), a2],
        [Step("answer", content="Edraand"), Step("subquery", content="Who founded Tova Lunn?", docs=[])],
        [Step("answer", content="never reached")],
    ]
    env = _ScriptedEnv(script)
    pairs, stats = sample_question(env, "q1", "Q?", samples=3, max_steps=6)
    # each prefix: one call of samples + 1; the walk ends at the trajectory's answer
    assert env.calls == [(0, 4), (1, 4), (2, 4)]
    assert [(len(p.context), p.steps[0].content, p.steps[1].content) for p in pairs] == [
        (0, "Who founded Mai Brewery?", "Who is Kora?"),          # the invalid step and the copy are not paired
        (1, "Tova Lunn", "Tova Lind"),                            # one name apart: kept, once
        (2, "Edraand", "Who founded Tova Lunn?")]
    assert [p.meta["step_kind"] for p in pairs] == ["subquery", "subanswer", "answer|subquery"]
    assert pairs[2].context == [q1, a1]  # the trajectory continues with each prefix's first sample
    assert stats == {"prefixes": 3, "sampled": 10, "invalid": 1, "duplicates": 3, "tokens": 36, "steps": 3,
                     "f1": 1.0, "reading_sampled": 0, "bridge_sampled": 0, "relation_sampled": 0}
    # the depth limit
    pairs, stats = sample_question(_ScriptedEnv(script), "q1", "Q?", samples=3, max_steps=1)
    assert stats["steps"] == 1 and len(pairs) == 1


def test_sample_question_adds_sub_answers_read_from_other_documents_after_a_search():
    from prorag.data.loaders import Document
    from services.trainer.stage_siblings import Counterfactuals, sample_question

    docs = [Document.from_parts("d1", "Mai Brewery", "Mai Brewery is a brewery. It was founded by Tova Lunn."),
            Document.from_parts("d2", "Lunn Hall", "a hall")]
    q1 = Step("subquery", content="Who founded Mai Brewery?", docs=docs)
    a1, a2 = Step("subanswer", content="Tova Lunn"), Step("subanswer", content="Tova Lind")
    script = [[q1, Step("subquery", content="Who is Kora?", docs=[])], [a1, a2],
              [Step("answer", content="Edraand")]]
    env = _ScriptedEnv(script)
    decoys = []
    pairs, stats = sample_question(env, "q1", "Q?", samples=1, max_steps=6, counterfactuals=Counterfactuals(
        reading_samples=2, decoy_docs=lambda: decoys.append(1) or [Document.from_parts("x", "Kora Fen", "-")]))
    # only the prefix that ends with a search asks for other readings: the top document dropped, the sentence
    # naming the trajectory's sub-answer (Tova Lunn) dropped, then the decoy; the walk still continues with the
    # real context's first sample
    assert env.calls == [(0, 2), (1, 2), ("reading", 1, ["Lunn Hall"], 2),
                         ("reading", 1, ["Mai Brewery", "Lunn Hall"], 2), ("reading", 1, ["Kora Fen"], 2), (2, 2)]
    assert decoys == [1] and stats["reading_sampled"] == 2 + 3 + 2 and stats["tokens"] == 3 * 6 + 3 * 4
    after_search = [p for p in pairs if len(p.context) == 1]
    # the real siblings' pair, then each reading against the real ones and each other; a copy (Lunn Hall read
    # twice) is paired once, and the subquery a reading sampled is left out (judged on a search never made)
    assert [(p.steps[0].content, p.steps[1].content) for p in after_search] == [
        ("Tova Lunn", "Tova Lind"), ("Tova Lunn", "Lunn Hall"), ("Tova Lunn", "Mai Brewery"),
        ("Tova Lunn", "Kora Fen"), ("Tova Lind", "Lunn Hall"), ("Tova Lind", "Mai Brewery"),
        ("Tova Lind", "Kora Fen"), ("Lunn Hall", "Mai Brewery"), ("Lunn Hall", "Kora Fen"),
        ("Mai Brewery", "Kora Fen")]
    assert [p.meta["source"] for p in after_search] == ["siblings"] + ["siblings-reading"] * 9
    assert all(p.context == [q1] for p in after_search)
    assert [p.meta["source"] for p in pairs if len(p.context) != 1] == ["siblings"]


def test_reason_counts_name_the_rejected_candidates_flaw():
    from services.trainer.stage_siblings import reason_counts

    def pair(choice, reason, kind="subanswer"):
        return StepPair("q", "Q?", [], (Step(kind, content="a"), Step(kind, content="b")), judge_choice=choice,
                        judge_reason=reason, meta={"step_kind": kind})

    pairs = [pair(0, "candidate 0: answers hop 1 from the retrieved documents; candidate 1: unsupported claim"),
             pair(1, "candidate 1: answers hop 1 from the retrieved documents; candidate 0: unsupported claim"),
             pair(None, "no contrast (candidate 0: wrong answer; candidate 1: wrong answer)"),
             pair(0, "Step 1 names the right director.", kind="subquery"),  # an LLM judge's free text
             pair(None, "", kind="subquery")]
    assert reason_counts(pairs) == {
        "subanswer": {"rejected: unsupported claim": 2, "declined: no contrast": 1},
        "subquery": {"rejected: Step 1 names the right director.": 1, "declined: -": 1}}
    assert reason_counts(pairs, top=1)["subanswer"] == {"rejected: unsupported claim": 2}


def test_the_sibling_sampler_refuses_the_test_split_as_mcts_does(tmp_path):
    """Pairs found on a split become training data: neither searching stage reads the test split."""
    import pytest

    from prorag.errors import InvalidArgument
    from services.trainer.search_env import questions_to_search
    from services.trainer.stage_mcts import MCTSStageConfig
    from services.trainer.stage_siblings import SiblingsStageConfig

    for split in ("test", "test_deep", "heldout_deep"):
        for cfg in (MCTSStageConfig(policy_model="m", split=split),
                    SiblingsStageConfig(policy_model="m", judge="127.0.0.1:1", split=split)):
            with pytest.raises(InvalidArgument, match=f"split '{split}' is held out"):
                questions_to_search(cfg)


def test_sample_question_adds_subqueries_that_carry_another_name_after_a_sub_answer():
    from services.trainer.stage_siblings import Counterfactuals, sample_question

    q1 = Step("subquery", content="Who founded Mai Brewery?", docs=[])
    a1, a2 = Step("subanswer", content="Tova Lunn"), Step("subanswer", content="Tova Lind")
    q2, q3 = Step("subquery", content="Where was Tova Lunn born?", docs=[]), Step("subquery", content="Who?", docs=[])
    script = [[q1, Step("subquery", content="Who is Kora?", docs=[])], [a1, a2], [q2, q3],
              [Step("answer", content="Edraand")]]
    env = _ScriptedEnv(script)
    pairs, stats = sample_question(env, "q1", "Q?", samples=1, max_steps=6, counterfactuals=Counterfactuals(
        bridge_samples=2, decoy_answers=("Tova Lunn", "Kora Fen", "Osk")))
    # only the prefix that ends with a sub-answer asks for bridges; the name is the decoy's hop answer at that hop
    # unless it is what was said (then the next one); the walk continues with the real context's first sample
    assert env.calls == [(0, 2), (1, 2), (2, 2), ("bridge", 2, "Kora Fen", 2), (3, 2)]
    assert stats["bridge_sampled"] == 3 and stats["tokens"] == 4 * 6 + 10
    after_answer = [p for p in pairs if len(p.context) == 2]
    # the bridge's sub-answer is left out (it is no search), its copy under the normaliser is paired once
    assert [(p.steps[0].content, p.steps[1].content, p.meta["source"]) for p in after_answer] == [
        ("Where was Tova Lunn born?", "Who?", "siblings"),
        ("Where was Tova Lunn born?", "Where was Kora Fen born?", "siblings-bridge"),
        ("Who?", "Where was Kora Fen born?", "siblings-bridge")]
    assert all(p.context == [q1, a1] and p.meta["step_kind"] == "subquery" for p in after_answer)
    assert {p.meta["source"] for p in pairs if len(p.context) != 2} == {"siblings"}


def test_bridge_name_is_the_decoys_answer_at_the_same_hop_and_never_what_was_said():
    from services.trainer.stage_siblings import bridge_name

    said = [Step("subquery", content="q"), Step("subanswer", content="Ana"), Step("subquery", content="q2"),
            Step("subanswer", content="Bo")]
    assert bridge_name(["Cid", "Dee", "Eve"], said) == "Dee"       # the second sub-answer: the decoy's second hop
    assert bridge_name(["Cid"], said) == "Cid"                    # fewer hops: the decoy's last
    assert bridge_name(["bo.", "Cid"], said) == "Cid"             # what was said (normalised) is never carried
    assert bridge_name(["BO"], said) == bridge_name([], said) == ""


def test_bridge_samples_pair_the_search_for_the_name_read_with_searches_for_another(services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    engine = services["engine"]
    engine.bridges = True
    try:
        metrics = run_siblings(local_context(tmp_path / "bridge", _config(services, bridge_samples=2,
                                                                             max_questions=16),
                                             stage="siblings"))
    finally:
        engine.bridges = False
    assert metrics["bridge_sampled"] > 0
    pairs = load_pairs(metrics["pairs_path"])
    bridge = [p for p in pairs if p.meta["source"] == "siblings-bridge"]
    assert len(bridge) == metrics["bridge_pairs"] > 0
    for p in bridge:
        assert p.context[-1].kind == "subanswer" and p.meta["step_kind"] == "subquery"
    # the judge prefers the search for the entity the context stated where the other names another question's
    labelled = [p for p in bridge if p.judge_choice is not None]
    assert len(labelled) == metrics["bridge_judge_labelled"] > 0
    assert reason_counts_of(labelled) == {"rejected: wrong entity": len(labelled)}


def test_sample_question_adds_sub_answers_to_another_relation_over_the_same_documents():
    from prorag.data.loaders import Document
    from services.trainer.stage_siblings import Counterfactuals, RelationTemplates, sample_question

    docs = [Document.from_parts("d1", "Zestron Ekandmont (banker)", "He was born in Cekexford in 1941.")]
    q1 = Step("subquery", content="Where was Zestron Ekandmont born?", docs=docs)
    a1, a2 = Step("subanswer", content="Cekexford"), Step("subanswer", content="Lasar")
    script = [[q1, Step("subquery", content="Who is Kora?", docs=[])], [a1, a2], [Step("answer", content="Edraand")]]
    env = _ScriptedEnv(script)
    templates = RelationTemplates({("", ""): ("Where was {entity} born?", "When was {entity} born?",
                                              "What did {entity} do?")})
    pairs, stats = sample_question(env, "q1", "Q?", samples=1, max_steps=6,
                                   counterfactuals=Counterfactuals(relation_samples=2, templates=templates))
    # only after the search, about its top document's entity (its title without the disambiguation), never the
    # relation asked; the subquery a relation sample wrote is left out (judged on a search never made)
    [call] = [c for c in env.calls if c[0] == "relation"]
    assert call[:2] == ("relation", 1) and call[3] == 2
    assert call[2] in ("When was Zestron Ekandmont born?", "What did Zestron Ekandmont do?")
    assert stats["relation_sampled"] == 2 and stats["tokens"] == 3 * 6 + 8
    after_search = [p for p in pairs if len(p.context) == 1]
    assert [(p.steps[0].content, p.steps[1].content, p.meta["source"]) for p in after_search] == [
        ("Cekexford", "Lasar", "siblings"), ("Cekexford", "1941", "siblings-relation"),
        ("Lasar", "1941", "siblings-relation")]
    # a search that does not name its top document's entity gets none
    env = _ScriptedEnv([[Step("subquery", content="Who is Kora?", docs=docs)], [a1], [Step("answer", content="x")]])
    sample_question(env, "q1", "Q?", samples=0, max_steps=6,
                    counterfactuals=Counterfactuals(relation_samples=2, templates=templates))
    assert not [c for c in env.calls if c[0] == "relation"]


def test_relation_templates_keep_the_hops_that_name_their_entity():
    from prorag.data.loaders import Question
    from services.trainer.stage_siblings import relation_question, relation_templates

    def hop(question, answer, doc_id, title):
        return {"question": question, "answer": answer, "doc_id": doc_id, "title": title}

    qs = [Question("a", "?", ["x"], metadata={"decomposition": [
              hop("Where was Ana Berg born?", "Lunn", "P1", "Ana Berg"),
              hop("Which country is Lunn in?", "Kryland", "C1", "Lunn (city)")]}),
          Question("b", "?", ["y"], metadata={"decomposition": [
              hop("Who directed it?", "Bo", "W1", "Iron Parade"),  # names no entity: no template
              hop("Where was Bo Lind born?", "Osk", "P2", "Bo Lind")]})]
    # no world entities (an imported corpus): every template for every document
    templates = relation_templates(qs).of("X9")
    assert templates == ["Where was {entity} born?", "Which country is {entity} in?"]
    assert relation_question(templates, "Where was Cy Moe born?", "Cy Moe", 4) == "Which country is Cy Moe in?"
    assert relation_question(templates, "Where was Cy Moe born?", "Ana Berg", 4) == ""  # not asked of it
    assert relation_question(["Where was {entity} born?"], "where was CY MOE born", "CY MOE", 0) == ""  # the same ask


def test_an_entity_is_asked_only_the_relations_of_its_kind_that_it_has():
    from prorag.data.loaders import Question
    from services.trainer.stage_siblings import relation_templates

    def hop(question, doc_id, title):
        return {"question": question, "answer": "-", "doc_id": doc_id, "title": title}

    qs = [Question("a", "?", ["x"], metadata={"chain": "W1.creator>P1.birth_city>C1.country", "decomposition": [
              hop("Who directed Iron Parade?", "W1", "Iron Parade"), hop("Where was Ana Berg born?", "P1", "Ana Berg"),
              hop("Which country is Lunn in?", "C1", "Lunn (city)")]}),
          Question("b", "?", ["y"], metadata={"chain": "P2.spouse&W2.creator", "decomposition": [
              hop("Who is Bo Lind married to?", "P2", "Bo Lind"), hop("Who recorded Blue Hour?", "W2", "Blue Hour")]})]
    entities = {"W1": ("film", frozenset({"creator", "genre"})), "W2": ("album", frozenset({"creator"})),
                "W3": ("film", frozenset({"genre"})),
                "P1": ("singer", frozenset({"birth_city", "spouse"})), "P2": ("singer", frozenset({"spouse"})),
                "P3": ("singer", frozenset({"birth_city"})), "C1": ("city", frozenset({"country"}))}
    templates = relation_templates(qs, entities)
    assert templates.of("W1") == ["Who directed {entity}?"]           # a film: never "Who recorded"
    assert templates.of("W2") == ["Who recorded {entity}?"]
    assert templates.of("W3") == []                                 # a film without a creator
    assert templates.of("P1") == ["Where was {entity} born?", "Who is {entity} married to?"]
    assert templates.of("P3") == ["Where was {entity} born?"]       # no spouse: not asked for one
    assert templates.of("C1") == ["Which country is {entity} in?"]
    assert templates.of("Z9") == sorted({t for ts in templates.by_kind_relation.values() for t in ts})  # unknown
    # never another phrasing of the relation the subquery asked: it would get the same answer
    assert templates.of("P1", "where was ANA BERG born", "Ana Berg") == ["Who is {entity} married to?"]
    assert templates.of("C1", "Which country is Lunn in?", "Lunn") == []
    assert templates.of("P1", "Who is Ana Berg?", "Ana Berg") == templates.of("P1")  # a relation no template asks


def test_relation_samples_pair_the_name_asked_for_with_what_the_documents_say_of_another_relation(
        services, tmp_path, one_thread):
    from services.trainer.stage_siblings import run_siblings

    engine = services["engine"]
    engine.reads = engine.relations = True
    try:
        metrics = run_siblings(local_context(tmp_path / "relation", _config(services, relation_samples=2,
                                                                               max_questions=12),
                                             stage="siblings"))
    finally:
        engine.reads = engine.relations = False
    assert metrics["relation_sampled"] > 0
    pairs = load_pairs(metrics["pairs_path"])
    relation = [p for p in pairs if p.meta["source"] == "siblings-relation"]
    assert len(relation) == metrics["relation_pairs"] > 0
    for p in relation:
        assert p.context[-1].kind == "subquery" and p.context[-1].docs and p.meta["step_kind"] == "subanswer"
    # the judge prefers the hop's answer where the other sub-answer names something else the same document says
    labelled = [p for p in relation if p.judge_choice is not None]
    assert len(labelled) == metrics["relation_judge_labelled"] > 0
    for p in labelled:
        text = " ".join(f"{d.title} {d.text}" for d in p.context[-1].docs)
        rejected = p.steps[1 - p.judge_choice]
        if p.meta["source"] == "siblings-relation" and rejected.content in text:
            break
    else:
        raise AssertionError("no labelled relation pair rejects a name its documents contain")
