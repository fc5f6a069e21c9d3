"""The embedded world: determinism, leakage-free splits, answerable gold decompositions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from shutil import copytree

import pytest

from prorag.config import ConfigError, from_dict
from prorag.data.loaders import load_corpus, load_split
from prorag.data.world import (CATEGORIES, DEEP_SPLIT, DEV_DEEP_SPLIT, HELDOUT_DEEP_SPLIT, RL_MIXED_SPLIT, RL_SPLIT,
                               SPLITS, WorldConfig, build_world, ensure_deep_split, ensure_drawn_split,
                               ensure_heldout_split, ensure_rl_split, generate_drawn_splits, load_summary)
from prorag.errors import InvalidArgument
from prorag.metrics import normalize_answer

FILES = ("corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "world.json", "DONE")


def tiny(seed: int = 0, **kw) -> WorldConfig:
    return from_dict(WorldConfig, {"name": "t", "size": "tiny", "seed": seed, **kw})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    t0 = time.perf_counter()
    summary = build_world(tiny(0), out)
    elapsed = time.perf_counter() - t0
    docs = {d.id: d for d in load_corpus(out / "corpus.jsonl")}
    splits = {s: load_split(out, s) for s in SPLITS}
    return {"dir": out, "summary": summary, "elapsed": elapsed, "docs": docs, "splits": splits,
            "meta": json.loads((out / "world.json").read_text())}


def test_tiny_builds_fast_and_counts(world):
    assert world["elapsed"] < 5.0
    s = world["summary"]
    assert s.splits == {"train": 300, "dev": 60, "test": 60}
    assert s.n_docs == len(world["docs"]) == world["meta"]["counts"]["entities"]
    assert 120 <= s.n_docs <= 180
    for name in FILES:
        assert (world["dir"] / name).exists()


def test_same_seed_same_bytes_other_seed_differs(world, tmp_path):
    a = tmp_path / "a"
    build_world(tiny(0), a)
    for name in FILES:
        assert (a / name).read_bytes() == (world["dir"] / name).read_bytes(), name
    b = tmp_path / "b"
    build_world(tiny(1), b)
    assert (b / "corpus.jsonl").read_bytes() != (a / "corpus.jsonl").read_bytes()
    assert (b / "test.jsonl").read_bytes() != (a / "test.jsonl").read_bytes()


def test_independent_of_string_hash_seed(world, tmp_path):
    # sets of strings iterate in PYTHONHASHSEED order: output must not depend on it
    code = ("import sys; from prorag.config import from_dict; from prorag.data.world import WorldConfig, build_world;"
            "build_world(from_dict(WorldConfig, {'name': 't', 'size': 'tiny', 'seed': 0}), sys.argv[1])")
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (world["dir"] / name).read_bytes(), name


def test_row_schema_exact(world):
    for line in (world["dir"] / "corpus.jsonl").read_text().splitlines()[:50]:
        row = json.loads(line)
        assert set(row) == {"id", "contents"}
        assert row["contents"].startswith('"') and '"\n' in row["contents"]
    for line in (world["dir"] / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert set(row) == {"id", "question", "golden_answers", "metadata"}
        m = row["metadata"]
        assert set(m) == {"type", "hops", "decomposition", "supporting_doc_ids", "chain"}
        assert m["type"] in ("compositional", "comparison", "bridge_comparison")
        assert isinstance(m["hops"], int) and row["golden_answers"] and all(isinstance(a, str) for a in
                                                                            row["golden_answers"])
        for step in m["decomposition"]:
            assert set(step) == {"question", "answer", "answer_aliases", "doc_id", "title"}


def test_splits_disjoint_by_chain_and_text(world):
    sp = world["splits"]
    chains = {s: {q.metadata["chain"] for q in sp[s]} for s in SPLITS}
    texts = {s: {q.question for q in sp[s]} for s in SPLITS}
    for s in ("dev", "test"):
        assert not chains[s] & chains["train"]
        assert not texts[s] & texts["train"]
    assert not chains["dev"] & chains["test"]
    for s in SPLITS:  # no duplicates within a split either
        assert len(chains[s]) == len(sp[s]) == len(texts[s])
    ids = [q.id for s in SPLITS for q in sp[s]]
    assert len(ids) == len(set(ids))


def _contains(haystack: str, needle: str) -> bool:
    return f" {normalize_answer(needle)} " in f" {normalize_answer(haystack)} "


def test_decompositions_are_supported_by_their_documents(world):
    docs = world["docs"]
    for s in SPLITS:
        for q in world["splits"][s]:
            steps = q.decomposition
            assert steps and q.hops == q.metadata["hops"]
            retrieval = [st for st in steps if st.doc_id]
            assert len(retrieval) == q.hops
            assert q.supporting_doc_ids == list(dict.fromkeys(st.doc_id for st in retrieval))
            for st in retrieval:
                doc = docs[st.doc_id]
                assert doc.title == st.title
                assert _contains(doc.title + " " + doc.text, st.answer), (q.id, st, doc.contents)
                assert st.answer in st.answer_aliases
                assert st.question.endswith("?")
            if q.qtype == "compositional":
                assert steps[-1].answer in q.golden_answers
                assert steps[-1].answer_aliases == q.golden_answers
            else:
                assert steps[-1].doc_id == "" and steps[-1].answer in q.golden_answers
                assert steps[-1].question == q.question


def test_subquestions_name_previous_answer(world):
    # hop k+1's sub-question mentions hop k's answer explicitly (the decomposition is self-contained)
    for q in world["splits"]["train"]:
        if q.qtype != "compositional":
            continue
        steps = q.decomposition
        for prev, nxt in zip(steps, steps[1:]):
            assert prev.answer.lower() in nxt.question.lower(), (prev, nxt)


def test_chains_follow_the_entity_graph(world):
    ents = {e["id"]: e for e in world["meta"]["entities"]}
    literal = {"birth_year": lambda e: e["attrs"]["birth_year"], "release_year": lambda e: e["attrs"]["release_year"],
               "founded_year": lambda e: e["attrs"]["founded_year"], "continent": lambda e: e["attrs"]["continent"],
               "occupation": lambda e: e["kind"]}
    for q in world["splits"]["train"]:
        if q.qtype != "compositional":
            continue
        edges = [edge.rsplit(".", 1) for edge in q.metadata["chain"].split(">")]
        assert [eid for eid, _ in edges] == [st.doc_id for st in q.decomposition]
        for (eid, rel), st in zip(edges, q.decomposition):
            e = ents[eid]
            value = ents[e["rels"][rel]]["name"] if rel in e["rels"] else str(literal[rel](e))
            assert value == st.answer


def _qualified(e: dict) -> str:
    if e["type"] == "city":
        return f"the city of {e['name']}"
    if e["type"] == "org":
        q = e["attrs"].get("industry") or ("football club" if e["kind"] == "club" else e["kind"])
        return f"the {q} {e['name']}"
    return f"the {e['kind']} {e['name']}"


def test_shared_names_are_always_qualified(world):
    # an entity whose name is shared is named with its kind ("the painter X") in every (sub-)question
    ents = {e["id"]: e for e in world["meta"]["entities"]}
    n_checked = 0
    for s in SPLITS:
        for q in world["splits"][s]:
            subjects = [ents[st.doc_id] for st in q.decomposition if st.doc_id]
            for st, e in zip([st for st in q.decomposition if st.doc_id], subjects):
                if e["shared_name"]:
                    assert _qualified(e).lower() in st.question.lower(), (st.question, e["name"])
                    n_checked += 1
            if q.qtype == "compositional" and subjects[0]["shared_name"]:
                assert _qualified(subjects[0]).lower() in q.question.lower()
    assert n_checked > 0


def test_distractors_exist(world):
    docs = world["docs"].values()
    bare = Counter(normalize_answer(re.sub(r" \([^)]*\)$", "", d.title)) for d in docs)
    assert max(bare.values()) >= 2, "no shared names"
    assert any(re.search(r" \([^)]*\)$", d.title) for d in docs)
    assert len({d.title for d in docs}) == len(docs)  # titles themselves stay unique
    # namesakes differ in their qualifier, so "the painter X" / "the album X" pick one
    ents = world["meta"]["entities"]
    groups: dict[str, list] = {}
    for e in ents:
        groups.setdefault(normalize_answer(e["name"]), []).append(e)
    for g in groups.values():
        if len(g) > 1:
            assert all(e["shared_name"] for e in g)
            assert sum(e["title"] == e["name"] for e in g) <= 1


def test_hop_and_type_distribution(world):
    for s in SPLITS:
        qs = world["splits"][s]
        hops = Counter(q.hops for q in qs if q.qtype == "compositional")
        assert set(hops) == {1, 2, 3, 4}
        types = Counter(q.qtype for q in qs)
        assert types["comparison"] > 0 and types["bridge_comparison"] > 0
    train = world["splits"]["train"]
    n = len(train)
    hops = Counter(q.hops for q in train if q.qtype == "compositional")
    assert hops[1] == pytest.approx(0.25 * n, abs=2) and hops[2] == pytest.approx(0.30 * n, abs=2)
    yn = Counter(q.golden_answers[0] for q in train if q.golden_answers[0] in ("yes", "no"))
    assert yn["yes"] > 0 and yn["no"] > 0


def test_mix_is_configurable(tmp_path):
    s = build_world(tiny(3, n_train=40, n_dev=10, n_test=10, frac_1hop=1, frac_2hop=0, frac_3hop=0,
                         frac_4hop=0, frac_comparison=0, frac_bridge_comparison=0), tmp_path)
    assert s.by_hops["train"] == {"1": 40} and s.by_type["test"] == {"compositional": 10}


def test_done_marker_reuse_and_partial_rebuild(tmp_path):
    s1 = build_world(tiny(5), tmp_path)
    assert not s1.reused
    s2 = build_world(tiny(5), tmp_path)
    assert s2.reused and s2.splits == s1.splits
    loaded = load_summary(tmp_path)
    assert loaded["splits"] == s1.splits and loaded["by_hops"] == s1.by_hops and loaded["seed"] == 5
    corpus = (tmp_path / "corpus.jsonl").read_bytes()
    (tmp_path / "DONE").unlink()  # as if the build died before finishing
    (tmp_path / "test.jsonl").write_text("garbage")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_split(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="DONE"):
        load_summary(tmp_path)
    s3 = build_world(tiny(5), tmp_path)
    assert not s3.reused and (tmp_path / "DONE").exists()
    assert (tmp_path / "corpus.jsonl").read_bytes() == corpus
    assert len(load_split(tmp_path, "test")) == 60
    # another config in the same folder is rebuilt, not reused
    assert not build_world(tiny(6), tmp_path).reused


def test_config_is_strict():
    with pytest.raises(ConfigError, match="size"):
        from_dict(WorldConfig, {"size": "huge"})
    with pytest.raises(ConfigError, match="unknown"):
        from_dict(WorldConfig, {"sizes": "tiny"})
    with pytest.raises(ConfigError):
        from_dict(WorldConfig, {"frac_1hop": 0, "frac_2hop": 0, "frac_3hop": 0, "frac_4hop": 0,
                                "frac_comparison": 0, "frac_bridge_comparison": 0})
    assert from_dict(WorldConfig, {"size": "small"}).resolved()["entities"] == 600


def test_summary_paths_and_progress(tmp_path):
    seen = []
    s = build_world(tiny(2), tmp_path, progress=lambda stage, done, total: seen.append(stage))
    assert {"entities", "documents", "questions train", "written"} <= set(seen)
    for p in s.paths.values():
        assert Path(p).exists()
    d = s.to_dict()
    assert d["by_type"]["train"]["compositional"] > 0 and json.dumps(d)


def test_canonical_question_writes_every_sub_question_of_a_relation_one_way(world):
    from prorag.data.world import canonical_question

    assert canonical_question("Who established Nond Builders?") == "Who founded Nond Builders?"
    assert canonical_question("Who was The Drowned Voyage written by?") == "Who wrote The Drowned Voyage?"
    assert canonical_question("What is Woshest's capital?") == "What is the capital of Woshest?"
    # a qualified mention that opened the question loses its capital; a name starting with "The" keeps it
    assert canonical_question("The city of Banflar is in which country?") == "In which country is the city of Banflar?"
    assert (canonical_question("The Silver Letter lies on which continent?")
            == "On which continent is The Silver Letter?")
    assert canonical_question("Who is older, A or B?") == "Who is older, A or B?"  # not a direct question: kept
    assert canonical_question("What is this?") == "What is this?"
    # over a generated world: every gold sub-question is recognised, keeps its entity, is idempotent, and
    # each (relation, entity) gets one phrasing
    subs = [s for split in world["splits"].values() for q in split for s in q.decomposition if s.doc_id]
    written = {}
    for s in subs:
        c = canonical_question(s.question)
        assert canonical_question(c) == c
        assert s.title.lower() in c.lower() or s.title.split(" (")[0].lower() in c.lower()
        written.setdefault((s.doc_id, s.answer), set()).add(c)
    assert sum(canonical_question(s.question) != s.question for s in subs) > len(subs) / 2
    assert len({c for cs in written.values() for c in cs}) < len({s.question for s in subs})


def test_a_deep_split_adds_three_plus_hop_questions_without_changing_the_world(world, tmp_path):
    import shutil

    from prorag.data.world import DEEP_SPLIT, ensure_deep_split, generate_deep_split, generate_world
    from prorag.errors import FailedPrecondition

    w, rows = generate_deep_split(tiny(0), 12)
    assert w["splits"] == generate_world(tiny(0))["splits"]  # the world's own splits are untouched
    assert len(rows) == 12 and Counter(r["metadata"]["hops"] for r in rows) == {3: 8, 4: 4}  # frac 0.20 : 0.10
    assert all(r["metadata"]["type"] == "compositional" and r["id"].startswith(DEEP_SPLIT) for r in rows)
    used_chains = {r["metadata"]["chain"] for s in w["splits"].values() for r in s}
    used_text = {r["question"] for s in w["splits"].values() for r in s}
    assert not any(r["metadata"]["chain"] in used_chains or r["question"] in used_text for r in rows)
    assert generate_deep_split(tiny(0), 12)[1] == rows  # a function of the world's config

    out = tmp_path / "w"
    shutil.copytree(world["dir"], out)
    path = ensure_deep_split(out, 12)
    qs = load_split(out, DEEP_SPLIT)
    assert [q.question for q in qs] == [r["question"] for r in rows]
    assert all(world["docs"][s.doc_id] for q in qs for s in q.decomposition if s.doc_id)  # answerable from the corpus
    before = path.stat().st_mtime_ns
    assert ensure_deep_split(out, 12) == path and path.stat().st_mtime_ns == before  # reused
    # a world whose splits this generator would not make (another version) gets no deep split
    lines = (out / "dev.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["question"] = "Something else?"
    (out / "dev.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    path.unlink()
    with pytest.raises(FailedPrecondition, match="rebuild it"):
        ensure_deep_split(out, 12)
    assert not path.exists()


def test_the_dev_deep_split_shares_nothing_with_the_test_one(world, tmp_path):
    import shutil

    from prorag.data.world import DEEP_SPLIT, DEV_DEEP_SPLIT, ensure_deep_split, generate_deep_split

    _, test_rows = generate_deep_split(tiny(0), 12)
    w, test_again, dev_rows = generate_deep_split(tiny(0), 12, dev=10)
    assert test_again == test_rows  # the test deep split is the same with or without a dev one drawn after it
    assert len(dev_rows) == 10 and all(r["id"].startswith(DEV_DEEP_SPLIT) for r in dev_rows)
    assert all(r["metadata"]["hops"] >= 3 for r in dev_rows)
    test_keys = {(r["metadata"]["chain"]) for r in test_rows} | {r["question"] for r in test_rows}
    assert not any(r["metadata"]["chain"] in test_keys or r["question"] in test_keys for r in dev_rows)
    used = {r["metadata"]["chain"] for s in w["splits"].values() for r in s}
    assert not any(r["metadata"]["chain"] in used for r in dev_rows)

    out = tmp_path / "w"
    shutil.copytree(world["dir"], out)
    # asked for first, the dev split draws (and writes) the test one before it, at the size given for the test one
    with pytest.raises(InvalidArgument, match="give its size"):
        ensure_deep_split(out, 10, "dev")  # no test size: nothing is guessed
    dev_path = ensure_deep_split(out, 10, "dev", test_n=12)
    assert [q.question for q in load_split(out, DEV_DEEP_SPLIT)] == [r["question"] for r in dev_rows]
    assert len(load_split(out, DEEP_SPLIT)) == 12
    before = dev_path.stat().st_mtime_ns
    assert ensure_deep_split(out, 10, "dev") == dev_path and dev_path.stat().st_mtime_ns == before  # reused
    # a test run at that size afterwards redraws nothing (it used to draw the test split at the dev size, so the
    # test run redrew it and with it the dev split under the same ids)
    ensure_deep_split(out, 12)
    assert dev_path.stat().st_mtime_ns == before
    # a test deep split rewritten with another size: the dev one is drawn again, after the new one
    ensure_deep_split(out, 11)
    ensure_deep_split(out, 10, "dev")
    assert [q.question for q in load_split(out, DEV_DEEP_SPLIT)] == [r["question"] for r in
                                                                    generate_deep_split(tiny(0), 11, dev=10)[2]]
    with pytest.raises(InvalidArgument, match="no deep split for 'train'"):
        ensure_deep_split(out, 10, "train")


def test_the_heldout_split_is_drawn_after_both_deep_splits_and_changes_neither(world, tmp_path):
    import shutil

    from prorag.data.world import (DEEP_SPLIT, DEV_DEEP_SPLIT, HELDOUT_DEEP_SPLIT, ensure_deep_split,
                                   ensure_heldout_split, generate_deep_split, generate_drawn_splits, generate_world)
    from prorag.errors import InvalidArgument

    _, test_rows, dev_rows = generate_deep_split(tiny(0), 12, dev=10)
    w, drawn = generate_drawn_splits(tiny(0), [(DEEP_SPLIT, 12), (DEV_DEEP_SPLIT, 10), (HELDOUT_DEEP_SPLIT, 20)])
    assert w["splits"] == generate_world(tiny(0))["splits"]
    assert drawn[DEEP_SPLIT] == test_rows and drawn[DEV_DEEP_SPLIT] == dev_rows  # the existing splits unchanged
    held = drawn[HELDOUT_DEEP_SPLIT]
    assert len(held) == 20 and all(r["id"].startswith(HELDOUT_DEEP_SPLIT) and r["metadata"]["hops"] >= 3 for r in held)
    before = [r for s in w["splits"].values() for r in s] + test_rows + dev_rows
    chains, texts = {r["metadata"]["chain"] for r in before}, {r["question"] for r in before}
    assert not any(r["metadata"]["chain"] in chains or r["question"] in texts for r in held)

    out = tmp_path / "w"
    shutil.copytree(world["dir"], out)
    ensure_deep_split(out, 12)  # the test deep split on disk; no dev one yet
    path = ensure_heldout_split(out, 20, test_n=99, dev_n=10)  # the test split's size on disk wins over test_n
    assert [q.question for q in load_split(out, HELDOUT_DEEP_SPLIT)] == [r["question"] for r in held]
    # the missing dev deep split was drawn before it, and written, so no later dev split can overlap it
    assert [q.question for q in load_split(out, DEV_DEEP_SPLIT)] == [r["question"] for r in dev_rows]
    assert ensure_deep_split(out, 10, "dev").stat().st_mtime_ns == (out / f"{DEV_DEEP_SPLIT}.jsonl").stat().st_mtime_ns
    stamp = path.stat().st_mtime_ns
    assert ensure_heldout_split(out, 20, test_n=12, dev_n=10) == path and path.stat().st_mtime_ns == stamp  # reused
    # a dev deep split redrawn with another size: the held-out split is drawn again after it, still disjoint
    ensure_deep_split(out, 8, "dev")
    ensure_heldout_split(out, 20, test_n=12, dev_n=99)  # the dev size on disk wins too
    _, again = generate_drawn_splits(tiny(0), [(DEEP_SPLIT, 12), (DEV_DEEP_SPLIT, 8), (HELDOUT_DEEP_SPLIT, 20)])
    held_again = again[HELDOUT_DEEP_SPLIT]
    assert [q.question for q in load_split(out, HELDOUT_DEEP_SPLIT)] == [r["question"] for r in held_again]
    assert (out / f"{HELDOUT_DEEP_SPLIT}.after").read_text().split() == ["12", "8"]
    with pytest.raises(InvalidArgument, match="at least 1"):
        ensure_heldout_split(out, 0, test_n=12, dev_n=8)


def test_the_rl_split_is_drawn_after_every_evaluation_split_and_changes_none(world, tmp_path):
    sizes = [(DEEP_SPLIT, 12), (DEV_DEEP_SPLIT, 10), (HELDOUT_DEEP_SPLIT, 8)]
    w, drawn = generate_drawn_splits(tiny(0), sizes + [(RL_SPLIT, 15)])
    assert generate_drawn_splits(tiny(0), sizes)[1] == {k: drawn[k] for k, _ in sizes}  # none changed by it
    rl = drawn[RL_SPLIT]
    before = [r for s in w["splits"].values() for r in s] + [r for k, _ in sizes for r in drawn[k]]
    chains, texts = {r["metadata"]["chain"] for r in before}, {r["question"] for r in before}
    assert len(rl) == 15 and all(r["metadata"]["hops"] >= 3 and r["metadata"]["decomposition"] for r in rl)
    assert not any(r["metadata"]["chain"] in chains or r["question"] in texts for r in rl)  # SFT and every eval

    out = tmp_path / "w"
    copytree(world["dir"], out)
    ensure_deep_split(out, 12)
    ensure_deep_split(out, 10, "dev")
    heldout = ensure_heldout_split(out, 8, test_n=12, dev_n=10)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*_deep.jsonl")}
    path = ensure_rl_split(out, 15, test_n=99, dev_n=99, heldout_n=99)  # the current splits on disk keep their sizes
    assert [q.question for q in load_split(out, RL_SPLIT)] == [r["question"] for r in rl]
    assert (out / f"{RL_SPLIT}.after").read_text().split() == ["12", "10", "8"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*_deep.jsonl") if p != path} == stamps  # none rewritten
    assert ensure_rl_split(out, 15, test_n=12, dev_n=10, heldout_n=8).stat().st_mtime_ns == path.stat().st_mtime_ns
    # a held-out split redrawn with another size: the RL split is drawn again after it, still disjoint from it
    ensure_heldout_split(out, 6, test_n=12, dev_n=10)
    ensure_rl_split(out, 15, test_n=12, dev_n=10, heldout_n=99)
    _, again = generate_drawn_splits(tiny(0), [(DEEP_SPLIT, 12), (DEV_DEEP_SPLIT, 10), (HELDOUT_DEEP_SPLIT, 6),
                                               (RL_SPLIT, 15)])
    assert [q.question for q in load_split(out, RL_SPLIT)] == [r["question"] for r in again[RL_SPLIT]]
    assert heldout.exists()

    # asked for on a world with none of the splits before it, it draws and writes them, given their sizes
    fresh = tmp_path / "fresh"
    copytree(world["dir"], fresh)
    with pytest.raises(InvalidArgument, match="drawn after the test_deep split, which is missing: give its size"):
        ensure_drawn_split(fresh, RL_SPLIT, 15, {})
    assert not (fresh / f"{RL_SPLIT}.jsonl").exists()
    ensure_rl_split(fresh, 15, test_n=12, dev_n=10, heldout_n=8)
    for split, _ in sizes:
        assert [q.question for q in load_split(fresh, split)] == [r["question"] for r in drawn[split]]
    with pytest.raises(InvalidArgument, match="no drawn split 'train'"):
        ensure_drawn_split(fresh, "train", 5, {})


def test_the_mixed_rl_split_follows_the_worlds_category_mix_after_the_deep_rl_split(world, tmp_path):
    sizes = [(DEEP_SPLIT, 12), (DEV_DEEP_SPLIT, 10), (HELDOUT_DEEP_SPLIT, 8), (RL_SPLIT, 15)]
    w, drawn = generate_drawn_splits(tiny(0), sizes + [(RL_MIXED_SPLIT, 40)])
    assert generate_drawn_splits(tiny(0), sizes)[1] == {k: drawn[k] for k, _ in sizes}  # none changed by it
    mixed = drawn[RL_MIXED_SPLIT]
    before = [r for s in w["splits"].values() for r in s] + [r for k, _ in sizes for r in drawn[k]]
    chains, texts = {r["metadata"]["chain"] for r in before}, {r["question"] for r in before}
    assert not any(r["metadata"]["chain"] in chains or r["question"] in texts for r in mixed)  # SFT, evals, RL
    # the world's own mix (tiny(0)'s default fractions), as its train split has it, not 3+ hops only
    want = dict(zip(CATEGORIES, [10, 12, 8, 4, 4, 2]))
    category = lambda m: f"{m['hops']}hop" if m["type"] == "compositional" else m["type"]
    assert Counter(category(r["metadata"]) for r in mixed) == Counter(want)
    assert [r["id"] for r in mixed] == [f"{RL_MIXED_SPLIT}_{i}" for i in range(40)]
    comparisons = [r["golden_answers"][0] for r in mixed if "comparison" in r["metadata"]["type"]]
    assert abs(comparisons.count("yes") - comparisons.count("no")) <= 2  # yes / no balanced as in the world's splits

    out = tmp_path / "w"
    copytree(world["dir"], out)
    for split, n in sizes[:3]:
        ensure_drawn_split(out, split, n, dict(sizes))
    path = ensure_rl_split(out, 40, test_n=12, dev_n=10, heldout_n=8, split=RL_MIXED_SPLIT, rl_deep_n=15)
    assert [q.question for q in load_split(out, RL_MIXED_SPLIT)] == [r["question"] for r in mixed]
    # the missing deep RL split was drawn and written before it, so the two never share a question
    assert [q.question for q in load_split(out, RL_SPLIT)] == [r["question"] for r in drawn[RL_SPLIT]]
    assert (out / f"{RL_MIXED_SPLIT}.after").read_text().split() == ["12", "10", "8", "15"]
    assert ensure_rl_split(out, 40, 12, 10, 8, split=RL_MIXED_SPLIT).stat().st_mtime_ns == path.stat().st_mtime_ns
    with pytest.raises(InvalidArgument, match="no RL split 'heldout_deep'"):
        ensure_rl_split(out, 40, 12, 10, 8, split=HELDOUT_DEEP_SPLIT)


def test_entity_relations_of_a_world_and_of_an_imported_corpus(tmp_path):
    import json

    from prorag.data.world.files import entity_relations

    (tmp_path / "world.json").write_text(json.dumps({"entities": [
        {"id": "C1", "kind": "city", "rels": {"country": "K1"}, "attrs": {"population": 5}}]}))
    assert entity_relations(tmp_path) == {"C1": ("city", frozenset({"country", "population"}))}
    assert entity_relations(tmp_path / "corpus-only") == {}
