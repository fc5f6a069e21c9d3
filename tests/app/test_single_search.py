"""The fair standard-RAG baseline (prorag_app.eval.run_single_search): the agent's model held to one search made
with the question, against real retriever and policy servers on loopback over the tiny world.

The policy server runs a scripted engine instead of a model (a policy that writes valid steps takes minutes of
training a unit test cannot spend); what is under test is what the runner sends it and makes of its answers:
the agent's 1-hop trajectory written around the question and its documents, in the token ids SFT trains on,
and the model's subanswer and answer read back up to their closing tags. Servers and retrieval are real.
"""

from __future__ import annotations

import threading

import pytest

from transformers import AutoTokenizer

from prorag.engine import GeneratedSeq
from tests.helpers import scripted_engine_base

ScriptedEngine = scripted_engine_base()
from prorag.data.sft import agent_prompt, content_prefix_ids, encode_segments, single_search_thoughts
from prorag.trajectory import Step, glue_after, render_prompt


class ReaderScript(ScriptedEngine):
    """Reads the gold answer as the subanswer and repeats it as the answer; for odd-numbered questions the answer
    runs on into a new subquery instead of closing (not format-valid, answer kept up to the first tag)."""

    name = "reader-script"

    def __init__(self, tok, questions, max_model_len=2048):
        self.tokenizer, self.max_model_len = tok, max_model_len
        self.by_prompt = {render_prompt(q.question): (i, q) for i, q in enumerate(questions)}
        self.seen: list[list[int]] = []
        self.lock = threading.Lock()

    def _next(self, i, q, generated: str) -> str:
        gold = q.golden_answers[0]
        if generated.rstrip().endswith("<subanswer>"):
            return f"{gold}</subanswer>"
        if generated.rstrip().endswith("<answer>"):
            return f"{gold}</step>\n<subquery>\nmore</subquery>" if i % 2 else f"{gold}</answer>"
        raise AssertionError(f"the runner asked for something else than a reading: {generated[-80:]!r}")

    def generate(self, prompts, params, adapter=None, seeds=None):
        from prorag.rollout import decode

        out = []
        for p in prompts:
            text = decode(self.tokenizer, p)
            with self.lock:
                self.seen.append(list(p))
            head = next(h for h in self.by_prompt if text.startswith(h))
            reply = self._next(*self.by_prompt[head], text[len(head):])
            # like the engine: generation ends at the first stop tag
            stop = min((reply.index(t) + len(t) for t in ("</subanswer>", "</answer>", "</subquery>") if t in reply))
            ids = self.tokenizer.encode(reply[:stop], add_special_tokens=False)
            out.append([GeneratedSeq(ids, [-0.5] * len(ids), "stop", ids[-1])])
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.services.trainer.scripted_stack import scripted_stack

    with scripted_stack(tmp_path_factory.mktemp("single") / "data", ReaderScript) as s:
        yield s


def test_one_search_with_the_question_written_as_the_agents_one_hop_trajectory_and_the_models_two_readings(stack):
    from prorag import paths
    from prorag.rpc.clients import PolicyClient, RetrieverClient
    from prorag.data.loaders import load_split
    from prorag_app.eval import evaluate, run_single_search

    questions = load_split(paths.world_dir("tiny"), "train")[:6]
    tok_dir = stack["base"]
    with PolicyClient(stack["policy"]) as policy, RetrieverClient(stack["retriever"]) as retriever:
        result = evaluate("standard_rag", policy, retriever, questions, topk=2, restate_question=True,
                          plan_thoughts=True, tokenizer_dir=tok_dir)
        records = run_single_search(policy, retriever, questions, topk=2, chunk=4, restate_question=True,
                                    plan_thoughts=True, tokenizer_dir=tok_dir)  # in two chunks: the same records
        expected_docs = retriever.search([q.question for q in questions], topk=2)

    assert result["overall"]["n"] == 6 and result["overall"]["em"] == 1.0
    assert result["format_valid_rate"] == pytest.approx(0.5)  # the odd questions' answers ran on
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    seen = stack["engine"].seen
    assert len(seen) == 2 * 2 * 6  # two readings per question, evaluated twice
    for i, (q, r, docs) in enumerate(zip(questions, records, expected_docs)):
        assert r["prediction"] == q.golden_answers[0] and r["f1"] == 1.0
        assert r["format_valid"] == (i % 2 == 0)
        assert r["retrieved_ids"] == [d.id for d in docs]
        search, read, final = single_search_thoughts(q.id, q.question, restate=True, plan=True)
        assert search.startswith("One search to go.") and read.endswith(q.question)
        assert final.startswith("No searches to go.")
        assert r["steps"] == [{"kind": "subquery", "thought": search, "content": q.question},
                              {"kind": "subanswer", "thought": read, "content": q.golden_answers[0]},
                              {"kind": "answer", "thought": final, "content": q.golden_answers[0]}]
        # what the model was given: the training sample of this trajectory, as SFT tokenises it, cut where each
        # reading begins: the question's documents after the question as its subquery, then its own subanswer
        steps = [Step("subquery", thought=search, content=q.question, docs=docs),
                 Step("subanswer", thought=read, content=q.golden_answers[0]),
                 Step("answer", thought=final, content=q.golden_answers[0])]
        sample = encode_segments(tokenizer, agent_prompt(q.question), steps, {}, {}).token_ids
        for upto in (2, 3):
            prefix = content_prefix_ids(tokenizer, agent_prompt(q.question), steps[:upto])
            assert seen.count(prefix) == 2 and sample[:len(prefix)] == prefix
            rest = tokenizer.decode(sample[len(prefix):], skip_special_tokens=False)
            assert rest.lstrip().startswith(q.golden_answers[0])  # the cut is right before the reading


def test_content_prefix_ids_cut_a_training_sample_right_before_the_last_steps_content(stack):
    tokenizer = AutoTokenizer.from_pretrained(stack["base"])
    prompt = agent_prompt("Where was Marlo Vesk born?")
    steps = [Step("subquery", thought="Next I search.", content="Where was Marlo Vesk born?", docs=[]),
             Step("subanswer", thought="Found.", content="Vuzarburg")]
    whole = encode_segments(tokenizer, prompt, steps, {}, {}).token_ids
    cut = content_prefix_ids(tokenizer, prompt, steps)
    assert whole[:len(cut)] == cut and len(cut) < len(whole)
    assert tokenizer.decode(whole[len(cut):], skip_special_tokens=False).strip() == "Vuzarburg</subanswer>\n<step>"
    # a text prefix ending at the content is tokenised otherwise (the space a word carries): why ids are sent
    text_prefix = tokenizer.encode(prompt + steps[0].text + glue_after(steps[0]) + "Found.</step>\n<subanswer>\n",
                                   add_special_tokens=False)
    assert text_prefix != cut
