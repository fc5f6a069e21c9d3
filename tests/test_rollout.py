"""run_rollouts: rounds, batched search, masks and log-probs, streaming, termination.

The orchestrator is pure, so search is a local function; a scripted engine drives exact
multi-step trajectories and the tiny random model supplies real garbage.
"""

import re

import pytest

from prorag import trajectory as T
from prorag.data.loaders import Document
from prorag.errors import InvalidArgument
from services.policy.engine import GeneratedSeq, GenerationEngine, SamplingSpec, TransformersEngine
from prorag.rollout import FINISH_REASONS, decode, run_rollouts, summarize


class Searcher:
    """Records every call; returns topk made-up documents per query."""

    def __init__(self):
        self.calls = []

    def __call__(self, queries, topk):
        self.calls.append(list(queries))
        return [[Document.from_parts(f"d{i}", f"Page {q[:12]} {i}", f"Text {i} about {q}.", score=1.0 / (i + 1))
                 for i in range(topk + 2)] for q in queries]  # more than topk: the rollout must cut


def char_ids(tok, text):
    """Non-canonical ids: tags as their special token, every other character encoded alone."""
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, T.TAGS + T.CHAT_TOKENS)) + ")", text):
        if piece in T.TAGS + T.CHAT_TOKENS:
            ids.append(tok.convert_tokens_to_ids(piece))
        else:
            for ch in piece:
                ids.extend(tok.encode(ch, add_special_tokens=False))
    return ids


class ScriptedEngine(GenerationEngine):
    """Returns a fixed list of step texts per question, one per round, as ids from ``encode``
    (default: non-canonical ids)."""

    name = "scripted"

    def __init__(self, tok, scripts, max_model_len=4096, encode=char_ids):
        self.tokenizer, self.scripts, self.max_model_len, self.encode = tok, scripts, max_model_len, encode
        self.calls = []
        self.step_end = tok.convert_tokens_to_ids("</step>")

    def generate(self, prompts, params, adapter=None, seeds=None):
        self.calls.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            text = decode(self.tokenizer, p)
            q = next(q for q in self.scripts if text.startswith(T.render_prompt(q)))
            n_prompt = len(self.tokenizer.encode(T.render_prompt(q), add_special_tokens=False))
            k = p[n_prompt:].count(self.step_end)  # steps generated so far (the system prompt names tags too)
            ids = self.encode(self.tokenizer, self.scripts[q][k])
            finish = "stop" if ids[-1] in params.stop_token_ids else "length"
            ids = ids[:params.max_tokens]
            out.append([GeneratedSeq(ids, [-0.25] * len(ids), finish, ids[-1] if finish == "stop" else None)])
        return out

    def load_adapter(self, key, path): ...
    def unload_adapter(self, key): ...
    def adapters(self): return []
    def info(self): return {"engine": self.name}


TWO_HOP = ["I need the director first.</step>\n<subquery>\nWho directed Inception?</subquery>",
           "The page names him.</step>\n<subanswer>\nChristopher Nolan</subanswer>",
           "Now his birthplace.</step>\n<subquery>\nWhere was Christopher Nolan born?</subquery>",
           "Found it.</step>\n<subanswer>\nLondon</subanswer>",
           "So the answer is London.</step>\n<answer>\nLondon</answer>"]
SCRIPTS = {
    "Where was the director of Inception born?": TWO_HOP,
    "What is two plus two?": ["Easy.</step>\n<answer>\nfour</answer>"],
    "Broken question?": ["Search.</step>\n<subquery>\nbroken</subquery>", "rambling without any tags at all"],
    "Loop question?": ["Hmm.</step>\n<subanswer>\nnothing</subanswer>"] * 20,
}


@pytest.fixture(scope="module")
def scripted_run(tiny_policy):
    tok = tiny_policy[1]
    engine, search, finished = ScriptedEngine(tok, SCRIPTS), Searcher(), []
    questions = [(f"q{i}", q) for i, q in enumerate(SCRIPTS)]
    results = run_rollouts(engine, tok, questions, SamplingSpec(n=1, max_tokens=200, seed=3), search,
                           max_steps=6, topk=3, adapter="policy@v1", on_finished=finished.append)
    return tok, engine, search, finished, results


def test_scripted_two_hop_is_valid(scripted_run):
    tok, _, _, _, results = scripted_run
    r = results[0]
    assert r.finish_reason == "answer" and r.format_valid and r.answer == "London"
    assert [s.kind for s in r.steps] == ["subquery", "subanswer", "subquery", "subanswer", "answer"]
    assert T.tag_sequence(r.steps) == "SQRSASQRSASF" and T.is_valid_format(r.steps)
    # cut to topk, shown on one line (the double space collapsed), ids and scores kept
    assert [(d.title, d.id) for d in r.steps[0].docs] == [(f"Page Who directed {i}", f"d{i}") for i in range(3)]
    assert r.tokens.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and r.tokens.generated_mask[-1] == 0
    assert r.adapter == "policy@v1" and r.rounds == 5
    # the text, parsed again, gives the same steps, and is the decoded ids
    assert r.text == decode(tok, r.tokens.token_ids[r.tokens.prompt_length:])
    assert T.render_prompt(r.question) + r.text == decode(tok, r.tokens.token_ids)
    again = T.parse_trajectory(r.text)
    assert [(s.kind, s.content) for s in again] == [(s.kind, s.content) for s in r.steps]
    assert [[(d.title, d.text) for d in s.docs] if s.docs else s.docs for s in again] == \
           [[(d.title, d.text) for d in s.docs] if s.docs else s.docs for s in r.steps]


def test_finish_reasons_and_rounds(scripted_run):
    _, _, _, finished, results = scripted_run
    by_q = {r.question_id: r for r in results}
    assert by_q["q1"].finish_reason == "answer" and by_q["q1"].answer == "four" and by_q["q1"].rounds == 1
    assert by_q["q1"].format_valid
    assert by_q["q2"].finish_reason == "invalid_format" and by_q["q2"].rounds == 2 and not by_q["q2"].format_valid
    assert by_q["q2"].steps[-1].kind == "invalid" and by_q["q2"].answer is None
    assert by_q["q3"].finish_reason == "max_steps" and len(by_q["q3"].steps) == 6
    # streamed in the order they ended: q1 (round 1), q2 (round 2), q0 (round 5), q3 (round 6)
    assert [r.question_id for r in finished] == ["q1", "q2", "q0", "q3"]
    assert [r.question_id for r in results] == ["q0", "q1", "q2", "q3"]  # returned in input order


def test_one_generate_and_one_search_per_round(scripted_run):
    _, engine, search, _, _ = scripted_run
    assert [len(c) for c in engine.calls] == [4, 3, 2, 2, 2, 1]
    # round 1: q0 and q2 subquery together; round 3: only q0
    assert search.calls == [["Who directed Inception?", "broken"], ["Where was Christopher Nolan born?"]]


def test_masks_logprobs_and_inserted_docs(scripted_run):
    tok, _, _, _, results = scripted_run
    for r in results:
        assert len(r.tokens.token_ids) == len(r.tokens.generated_mask) == len(r.tokens.logprobs)
        assert r.tokens.generated_mask[:r.tokens.prompt_length] == [0] * r.tokens.prompt_length
        assert sum(r.tokens.generated_mask) == r.tokens.generated_tokens
        for m, lp in zip(r.tokens.generated_mask, r.tokens.logprobs):
            assert lp == (-0.25 if m else 0.0)
    tt = results[0].tokens
    inserted = decode(tok, [t for t, m in zip(tt.token_ids[tt.prompt_length:], tt.generated_mask[tt.prompt_length:])
                            if m == 0])
    generated = decode(tok, [t for t, m in zip(tt.token_ids, tt.generated_mask) if m == 1])
    assert "Doc 1(Title: Page Who directed 0) Text 0 about Who directed Inception?." in inserted
    assert "<retrieval>" in inserted and "</retrieval>" in inserted and "Doc 1" not in generated
    assert "</subquery>" in generated and "</subquery>" not in inserted


def test_ids_are_carried_not_reencoded(scripted_run):
    tok, engine, _, _, results = scripted_run
    r = results[0]
    # the engine's non-canonical ids are kept verbatim ...
    assert r.tokens.token_ids != tok.encode(decode(tok, r.tokens.token_ids), add_special_tokens=False)
    # ... and every prompt the engine saw for this trajectory is a prefix of its final ids
    seen = [c[0] for c in engine.calls[:5]]  # q0 is first in every round it is in
    for p in seen:
        assert r.tokens.token_ids[:len(p)] == p
    assert len(seen) == 5 and all(len(a) < len(b) for a, b in zip(seen, seen[1:]))


def test_context_limit_ends_with_length(tiny_policy):
    tok = tiny_policy[1]
    q = "Where was the director of Inception born?"
    limit = len(tok.encode(T.render_prompt(q), add_special_tokens=False)) + len(char_ids(tok, TWO_HOP[0])) + 5
    res = run_rollouts(ScriptedEngine(tok, SCRIPTS, max_model_len=limit), tok, [("a", q)],
                       SamplingSpec(max_tokens=200), Searcher(), topk=3)
    # the first step fits, its retrieval block does not
    assert res[0].finish_reason == "length" and len(res[0].tokens.token_ids) <= limit
    assert res[0].steps[0].kind == "subquery" and res[0].steps[0].docs is None


def test_random_model_garbage_terminates(tiny_policy):
    model_dir, tok = tiny_policy
    engine = TransformersEngine(model_dir, max_batch_size=32)
    search, finished = Searcher(), []
    qs = [("a", "Who founded the city?"), ("b", "When was the band born?"), ("c", "What river?")]
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=24, seed=9)
    res = run_rollouts(engine, tok, qs, spec, search, max_steps=4, on_finished=finished.append)
    assert len(res) == 9 and len(finished) == 9
    assert [(r.question_id, r.sample_index) for r in res] == [(q, j) for q, _ in qs for j in range(3)]
    for r in res:
        assert r.finish_reason in FINISH_REASONS and 1 <= len(r.steps) <= 4
        assert len(r.tokens.token_ids) == len(r.tokens.generated_mask) == len(r.tokens.logprobs) <= engine.max_model_len
        assert r.tokens.generated_tokens == sum(r.tokens.generated_mask) > 0
        assert all(lp < 0 for lp, m in zip(r.tokens.logprobs, r.tokens.generated_mask) if m)
        assert all(lp == 0 for lp, m in zip(r.tokens.logprobs, r.tokens.generated_mask) if not m)
    assert summarize(res)["trajectories"] == 9
    # seeded: the same call gives the same trajectories
    again = run_rollouts(engine, tok, qs, spec, search, max_steps=4)
    assert [r.tokens.token_ids for r in again] == [r.tokens.token_ids for r in res]
    # a random model at a 1-token step budget ends every trajectory at round 1
    short = run_rollouts(engine, tok, qs[:1], SamplingSpec(n=2, max_tokens=1, seed=1), search, max_steps=13)
    assert all(r.finish_reason == "invalid_format" and r.rounds == 1 for r in short)


class SeedRecordingEngine(ScriptedEngine):
    """The scripted engine, recording the seeds of every generate call (one list per round)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seeds = []

    def generate(self, prompts, params, adapter=None, seeds=None):
        self.seeds.append(list(seeds))
        return super().generate(prompts, params, adapter, seeds)


def test_a_request_split_with_question_offsets_samples_with_the_whole_requests_seeds(tiny_policy):
    tok = tiny_policy[1]
    questions = [(f"q{i}", q) for i, q in enumerate(SCRIPTS)]
    spec = SamplingSpec(n=2, max_tokens=200, seed=3)
    whole = SeedRecordingEngine(tok, SCRIPTS)
    whole_res = run_rollouts(whole, tok, questions, spec, Searcher(), max_steps=6)
    parts = [SeedRecordingEngine(tok, SCRIPTS), SeedRecordingEngine(tok, SCRIPTS)]
    part_res = (run_rollouts(parts[0], tok, questions[:1], spec, Searcher(), max_steps=6)
                + run_rollouts(parts[1], tok, questions[1:], spec, Searcher(), max_steps=6, question_offset=1))
    # the scripts end each question at the same round either way, so round r's seeds of the two parts, in order,
    # are those the whole request drew at round r
    rounds = max(len(whole.seeds), *(len(e.seeds) for e in parts))
    joined = [sum((e.seeds[r] if r < len(e.seeds) else [] for e in parts), []) for r in range(rounds)]
    assert joined == whole.seeds and len(set(whole.seeds[0])) == len(questions) * 2  # every trajectory its own
    assert [(r.question_id, r.sample_index, r.tokens.token_ids) for r in part_res] == \
        [(r.question_id, r.sample_index, r.tokens.token_ids) for r in whole_res]
    # without the offset the second part would reuse the first question's seeds
    alone = SeedRecordingEngine(tok, SCRIPTS)
    run_rollouts(alone, tok, questions[1:], spec, Searcher(), max_steps=6)
    assert alone.seeds[0][:2] == whole.seeds[0][:2] != whole.seeds[0][2:4]
    with pytest.raises(InvalidArgument, match="question_offset"):
        run_rollouts(whole, tok, questions, spec, Searcher(), question_offset=-1)


def test_bad_arguments(tiny_policy):
    tok = tiny_policy[1]
    eng = ScriptedEngine(tok, SCRIPTS)
    with pytest.raises(InvalidArgument):
        run_rollouts(eng, tok, [("a", "  ")], SamplingSpec(), Searcher())
    with pytest.raises(InvalidArgument):
        run_rollouts(eng, tok, [("a", "q")], SamplingSpec(), Searcher(), max_steps=0)
    with pytest.raises(InvalidArgument):
        run_rollouts(eng, tok, [("a", "Broken question?")], SamplingSpec(), lambda qs, k: [])


@pytest.fixture(scope="module")
def retrievers(tmp_path_factory):
    """Two real retriever services (gRPC on loopback, port 0) over a small BM25 index: one with the default
    max_batch (512), one with max_batch 16."""
    import json

    from prorag.rpc.clients import RetrieverClient
    from prorag.rpc.service import ServeConfig
    from services.retriever.indexing import build_all
    from services.retriever.server import RetrieverConfig, start
    from tests.helpers import LoopThread

    root = tmp_path_factory.mktemp("rollout-retriever")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"Film {i}"\nFilm {i} was directed by '
                                                                        f'Person {i}, born in Town {i}.'}) + "\n"
                              for i in range(40)))
    build_all(corpus, root / "indexes", dense=False)
    loop = LoopThread()
    servers, clients = {}, {}
    for max_batch in (512, 16):
        cfg = RetrieverConfig(index_root=str(root / "indexes"), default_index="bm25", max_batch=max_batch)
        servers[max_batch] = loop.run(start(ServeConfig(port=0, http_port=-1), cfg))
        clients[max_batch] = RetrieverClient(f"127.0.0.1:{servers[max_batch].grpc_port}")
    yield clients
    for max_batch, s in servers.items():
        clients[max_batch].close()
        loop.run(s.stop())
    loop.close()


def test_a_round_over_the_retrievers_max_batch_is_searched_in_chunks(tiny_policy, retrievers):
    """600 subqueries in one round against a retriever that takes 512 per request, searched as the policy's
    rollouts search (one client.search per search_fn call): chunked, so every trajectory gets its documents."""
    tok, client = tiny_policy[1], retrievers[512]
    calls = []

    def search(queries, topk):
        calls.append(len(queries))
        return client.search(queries, topk=topk)

    q = "Where was the director of Inception born?"
    # the cache off: the samples' identical subqueries are each searched, as a policy whose samples differ would
    res = run_rollouts(ScriptedEngine(tok, SCRIPTS), tok, [("a", q)], SamplingSpec(n=600, max_tokens=200),
                       search, topk=2, search_cache=False)
    assert all(r.finish_reason == "answer" and len(r.steps[0].docs) == 2 for r in res)
    assert max(calls) <= 256 and sum(calls) == 1200  # two search rounds of 600


def test_the_search_batch_comes_from_the_search_function_when_it_knows_the_retrievers_limit(tiny_policy, retrievers):
    tok, client = tiny_policy[1], retrievers[16]

    def search(queries, topk):
        return client.search(queries, topk=topk)

    search.max_batch = client.list_indexes().max_batch  # what the retriever says it takes
    q = "Where was the director of Inception born?"
    res = run_rollouts(ScriptedEngine(tok, SCRIPTS), tok, [("a", q)], SamplingSpec(n=40, max_tokens=200),
                       search, topk=2, search_cache=False)
    assert all(r.finish_reason == "answer" and len(r.steps[2].docs) == 2 for r in res)
    # an explicit search_batch wins
    res = run_rollouts(ScriptedEngine(tok, SCRIPTS), tok, [("a", q)], SamplingSpec(n=20, max_tokens=200),
                       search, topk=2, search_batch=7, search_cache=False)
    assert all(r.finish_reason == "answer" for r in res)


def test_each_distinct_subquery_is_searched_once_per_call_and_the_trajectories_do_not_change(tiny_policy, retrievers):
    tok, client = tiny_policy[1], retrievers[512]
    asked = []

    def search(queries, topk):
        asked.append(list(queries))
        return client.search(queries, topk=topk)

    qs = [("a", "Where was the director of Inception born?"), ("b", "Broken question?")]
    stats: dict = {}
    cached = run_rollouts(ScriptedEngine(tok, SCRIPTS), tok, qs, SamplingSpec(n=8, max_tokens=200), search, topk=2,
                          stats=stats)
    made = [q for call in asked for q in call]
    assert len(made) == len(set(made))  # never the same subquery twice in one call
    assert stats["searches_made"] == len(made) < stats["searches_asked"]
    assert stats["searches_asked"] == sum(1 for r in cached for s in r.steps if s.kind == "subquery")
    asked.clear()
    plain = run_rollouts(ScriptedEngine(tok, SCRIPTS), tok, qs, SamplingSpec(n=8, max_tokens=200), search, topk=2,
                         search_cache=False)
    assert sum(len(call) for call in asked) == stats["searches_asked"]
    assert [r.tokens.token_ids for r in plain] == [r.tokens.token_ids for r in cached]


def test_the_retriever_client_splits_a_search_over_the_servers_max_batch(retrievers):
    client = retrievers[16]
    queries = [f"Who directed Inception? ({i})" for i in range(40)]
    results = client.search(queries, topk=2)
    assert client.max_batch() == 16 and len(results) == 40 and all(len(r) == 2 for r in results)
    assert [r[0].id for r in results[:16]] == [r[0].id for r in client.search(queries[:16], topk=2)]
