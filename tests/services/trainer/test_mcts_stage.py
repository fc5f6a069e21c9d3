"""The MCTS stage against real retriever, policy and judge servers on loopback (port 0), on the tiny world:
trees and sibling pairs written, every pair two siblings under one context, prefixes sent to the policy equal to
the rendered trajectory, retrieval cached across the run, judge labels from the judge service, and a stopped
job resuming without searching finished questions again.

The policy server runs a scripted engine (GoldWalkEngine) instead of a model: a policy that writes valid steps
takes minutes of training that a unit test cannot spend, and the stage under test only needs steps that are
sometimes right and sometimes wrong. Everything else (servers, retrieval, judging, the search) is real.
"""

from __future__ import annotations

from prorag.io import read_jsonl
from prorag.search.mcts import step_key
from prorag.search.pairs import StepPair
from prorag.training.context import local_context
from prorag.engine import GeneratedSeq
from tests.helpers import scripted_engine_base
from tests.services.trainer.scripted_stack import journal_after_a_stop, search_stage_config, stack_fixture

ScriptedEngine = scripted_engine_base()


class GoldWalkEngine(ScriptedEngine):
    """Next step of a tiny-world question, drawn per seed: the gold hop's sub-question or another question's
    (a wrong entity), the gold sub-answer or a wrong one after a search, then the last sub-answer as the answer."""

    name = "gold-walk"

    def __init__(self, tok, questions, max_model_len=2048):
        from prorag.trajectory import render_prompt

        self.tokenizer, self.max_model_len = tok, max_model_len
        self.by_prompt = {render_prompt(q.question): q for q in questions}
        self.others = [h.question for q in questions for h in q.decomposition if h.doc_id][:50]

    def _next(self, q, generated: str, rng) -> str:
        hop = generated.count("</subanswer>")
        hops = [h for h in q.decomposition if h.doc_id]
        if generated.rstrip().endswith("</retrieval>") or generated.rstrip().endswith("<step>") and \
                generated.count("</subquery>") > hop:
            answer = hops[min(hop, len(hops) - 1)].answer if rng.random() < 0.6 else rng.choice(["Nobody", "1900"])
            return f"The document says.</step>\n<subanswer>\n{answer}</subanswer>"
        if hop < len(hops):
            sub = hops[hop].question if rng.random() < 0.6 else rng.choice(self.others)
            return f"Next I search.</step>\n<subquery>\n{sub}</subquery>"
        last = generated.rsplit("<subanswer>\n", 1)[-1].split("</subanswer>")[0] if hop else "unknown"
        return f"That answers it.</step>\n<answer>\n{last}</answer>"

    def generate(self, prompts, params, adapter=None, seeds=None):
        import random

        from prorag.rollout import decode

        out = []
        for i, p in enumerate(prompts):
            text = decode(self.tokenizer, p)
            head = next(h for h in self.by_prompt if text.startswith(h))
            seqs = []
            for j in range(params.n):
                rng = random.Random(((seeds[i] if seeds else params.seed) or 0) * 131 + j)
                ids = self.tokenizer.encode(self._next(self.by_prompt[head], text[len(head):], rng),
                                            add_special_tokens=False)
                seqs.append(GeneratedSeq(ids, [-0.5] * len(ids), "stop", ids[-1]))
            out.append(seqs)
        return out


services = stack_fixture("mcts", GoldWalkEngine, judge=True)


def _config(services, **kw):
    from services.trainer.stage_mcts import MCTSStageConfig

    return search_stage_config(MCTSStageConfig, services, **{
        "mcts": {"simulations": 6, "expansions": 3, "max_children": 3, "max_depth": 4, "rollouts": 1}, **kw})


def test_mcts_stage_writes_trees_and_sibling_pairs_through_the_services(services, tmp_path, one_thread):
    from services.trainer.stage_mcts import run_mcts

    cfg = _config(services)
    metrics = run_mcts(local_context(tmp_path / "job", cfg, stage="mcts"))
    trees = list(read_jsonl(tmp_path / "job" / "run" / "trees.jsonl"))
    pairs = [StepPair.from_dict(r) for r in read_jsonl(tmp_path / "job" / "run" / "pairs.jsonl")]
    assert metrics["questions"] == len(trees) == 6
    for t in trees:
        root = t["tree"]
        assert t["stats"]["simulations"] == root["visits"] <= 6  # every simulation backs up through the root
        assert all(c["depth"] == 1 for c in root["children"]) and len(root["children"]) <= 3
    assert metrics["simulations"] == sum(t["stats"]["simulations"] for t in trees)
    assert metrics["pairs"] == len(pairs) and metrics["pairs_per_question"] == len(pairs) / 6
    assert metrics["generated_tokens"] > 0 and metrics["policy_calls"] > 0
    # retrieval: repeated subqueries (siblings, rollouts) are served from the run's cache
    assert metrics["retrieval_searches"] >= 1 and 0.0 < metrics["retrieval_cache_hit_rate"] < 1.0
    assert metrics["pairs"] > 0 and metrics["value_labelled"] > 0
    for p in pairs:
        assert p.steps[0] is not p.steps[1] and p.visits[0] >= 1 and p.visits[1] >= 1
        # every pair of valid, distinct siblings, labelled by the value margin either way
        assert p.steps[0].valid and p.steps[1].valid and step_key(p.steps[0]) != step_key(p.steps[1])
        margin = p.values[0] - p.values[1]
        assert p.value_choice == (0 if margin >= cfg.min_margin else 1 if -margin >= cfg.min_margin else None)
        assert p.meta["source"] == "mcts"
    # counted per step kind, in the metrics as numbers too
    by_kind = metrics["pairs_by_kind"]
    assert sum(c["pairs"] for c in by_kind.values()) == len(pairs)
    for kind, counts in by_kind.items():
        mine = [p for p in pairs if p.meta["step_kind"] == kind]
        assert counts == {"pairs": len(mine), "value_labelled": sum(p.value_choice is not None for p in mine),
                          "judge_labelled": sum(p.judge_choice is not None for p in mine)}
        assert metrics[f"pairs_by_kind.{kind}.judge_labelled"] == counts["judge_labelled"]
    # two siblings under one context make one pair at most
    seen = [(p.question_id, tuple(step_key(s) for s in p.context), frozenset(map(step_key, p.steps))) for p in pairs]
    assert len(seen) == len(set(seen))
    # the judge service labelled the pairs it could decide
    assert 0 < metrics["judge_labelled"] == sum(p.judge_choice is not None for p in pairs)
    both = [p for p in pairs if p.judge_choice is not None and p.value_choice is not None]
    assert metrics["both_labelled"] == len(both)
    if both:
        assert metrics["judge_value_agreement"] == sum(p.judge_choice == p.value_choice for p in both) / len(both)


def test_prefixes_sent_to_the_policy_are_the_rendered_trajectory(services, one_thread):
    from transformers import AutoTokenizer

    from prorag.rpc.clients import PolicyClient, RetrieverClient
    from services.trainer.search_env import CachedSearch, ServiceEnv
    from prorag.rollout import decode
    from prorag.trajectory import render_trajectory

    tok = AutoTokenizer.from_pretrained(services["base"])
    with PolicyClient(services["policy"]) as policy, RetrieverClient(services["retriever"]) as retriever:
        cache = CachedSearch(retriever, topk=1)
        from prorag import paths
        from prorag.data.loaders import load_split

        question = next(q for q in load_split(paths.world_dir("tiny"), "train") if q.hops >= 2).question
        env = ServiceEnv(policy, cache, tok, question, ["x"], temperature=1.0, max_step_tokens=48, max_steps=4,
                         seed=5)
        history = []
        for _ in range(3):
            steps, tokens = env.expand(history, 2)
            assert len(steps) == 2 and tokens > 0
            if steps[0].kind in ("answer", "invalid"):
                break
            history.append(steps[0])
        assert decode(tok, env.prefix(history)) == render_trajectory(question, history)
        # a second search for the same subquery is a cache hit
        searched = [s for s in history if s.kind == "subquery"]
        if searched:
            before = cache.hits
            assert cache(searched[0].content) == searched[0].docs
            assert cache.hits == before + 1


def test_stopped_mcts_job_resumes_without_searching_finished_questions_again(services, tmp_path, one_thread):
    from services.trainer.stage_mcts import run_mcts

    cfg = _config(services, judge="", max_questions=4, concurrency=1)
    journal = journal_after_a_stop(run_mcts, cfg, tmp_path / "job", "mcts")
    assert len(journal) < 4
    first = {r["question_id"]: r["tree"] for r in journal}
    metrics = run_mcts(local_context(tmp_path / "job", cfg, stage="mcts"))
    trees = {r["question_id"]: r["tree"] for r in read_jsonl(tmp_path / "job" / "run" / "trees.jsonl")}
    assert metrics["questions"] == 4 == len(trees)
    assert all(trees[q] == t for q, t in first.items())  # finished questions kept as they were
    assert metrics["policy_calls"] > 0  # the unfinished ones were searched now
