"""Pure functions that build SFT samples and the format-aware loss."""

import torch

from prorag.data.loaders import Question
from prorag.data.sft import (agent_steps, baseline_prompt, baseline_steps, encode_segments, ensure_gold,
                             length_grouped_batches, plan_note)
from prorag.data.loaders import Document
from prorag.trajectory import FORMAT_LOSS_WEIGHTS, TAGS, is_valid_format, render_prompt


def _question():
    return Question(id="q1", question="Where was the director of Red Harbour born?", golden_answers=["Vuzarburg"],
                    metadata={"type": "compositional", "hops": 2, "decomposition": [
                        {"question": "Who directed Red Harbour?", "answer": "Marlo Vesk", "answer_aliases": [],
                         "doc_id": "W1", "title": "Red Harbour"},
                        {"question": "Where was Marlo Vesk born?", "answer": "Vuzarburg", "answer_aliases": [],
                         "doc_id": "P1", "title": "Marlo Vesk"}]})


GOLD = {"W1": Document.from_parts("W1", "Red Harbour", "Red Harbour was directed by Marlo Vesk."),
        "P1": Document.from_parts("P1", "Marlo Vesk", "Marlo Vesk was born in Vuzarburg.")}
OTHER = [Document.from_parts(f"X{i}", f"T{i}", f"text {i}") for i in range(3)]


def test_ensure_gold_keeps_or_inserts_the_supporting_document():
    assert [d.id for d in ensure_gold([GOLD["W1"]] + OTHER, GOLD["W1"], 3)] == ["W1", "X0", "X1"]
    assert [d.id for d in ensure_gold(OTHER, GOLD["W1"], 3)] == ["X0", "X1", "W1"]
    assert [d.id for d in ensure_gold([], GOLD["W1"], 3)] == ["W1"]


def test_agent_steps_are_a_valid_prorag_trajectory():
    q = _question()
    steps = agent_steps(q, {"Who directed Red Harbour?": OTHER}, GOLD, topk=3)
    assert [s.kind for s in steps] == ["subquery", "subanswer", "subquery", "subanswer", "answer"]
    assert is_valid_format(steps)
    assert steps[0].content == "Who directed Red Harbour?" and steps[1].content == "Marlo Vesk"
    assert GOLD["W1"] in steps[0].docs and GOLD["P1"] in steps[2].docs
    assert steps[-1].content == "Vuzarburg"


class _CharTokenizer:
    """A character-level stand-in with tags as single ids (the real tokenizer is tested elsewhere)."""

    def __init__(self):
        self.special = {t: i for i, t in enumerate(TAGS + ("<|im_end|>", "<|im_start|>", "<think>", "</think>"))}

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            for t, tid in self.special.items():
                if text.startswith(t, i):
                    out.append(tid)
                    i += len(t)
                    break
            else:
                out.append(1000 + ord(text[i]))
                i += 1
        return out


def test_encode_masks_everything_but_generated_steps_and_weights_tags():
    tok = _CharTokenizer()
    q = _question()
    steps = agent_steps(q, {}, GOLD, topk=3)
    prompt = render_prompt(q.question)
    enc = encode_segments(tok, prompt, steps, {t: tok.special[t] for t in TAGS}, FORMAT_LOSS_WEIGHTS)
    assert len(enc.token_ids) == len(enc.generated_mask) == len(enc.weights)
    n_prompt = len(tok.encode(prompt))
    assert not any(enc.generated_mask[:n_prompt])
    trained = [t for t, m in zip(enc.token_ids, enc.generated_mask) if m]
    assert sum(len(tok.encode(s.text)) for s in steps) == len(trained)
    # documents are inserted, never trained on
    doc_ids = tok.encode("Vuzarburg.")  # appears in P1's text (inserted) and as the answer (generated)
    assert len(trained) < len(enc.token_ids) - n_prompt
    w = dict(zip(enc.token_ids, enc.weights))
    assert w[tok.special["<answer>"]] == 5.0 and w[tok.special["</step>"]] == 2.0
    assert w[tok.special["<subquery>"]] == 3.0
    assert all(wt == 0.0 for wt, m in zip(enc.weights, enc.generated_mask) if not m)
    assert doc_ids


def test_restate_puts_the_question_answered_at_the_end_of_the_thought_before_each_answer():
    q = _question()
    plain = agent_steps(q, {}, GOLD, topk=3)
    steps = agent_steps(q, {}, GOLD, topk=3, restate=True)
    assert is_valid_format(steps)
    assert [s.content for s in steps] == [s.content for s in plain]
    assert steps[1].thought == f"{plain[1].thought} Who directed Red Harbour?"
    assert steps[3].thought.endswith("Where was Marlo Vesk born?")
    # the subanswer's text: restated subquery, then the tags, then the answer
    assert steps[3].text.endswith("Where was Marlo Vesk born?</step>\n<subanswer>\nVuzarburg</subanswer>")
    # subqueries and a compositional final answer (it repeats the last subanswer) keep their thoughts
    assert [steps[i].thought for i in (0, 2, 4)] == [plain[i].thought for i in (0, 2, 4)]
    comparison = Question(id="q2", question="Who was born first, Marlo Vesk or Ada Pell?", golden_answers=["Ada Pell"],
                          metadata={"type": "comparison", "hops": 2, "decomposition": [
                              {"question": "When was Marlo Vesk born?", "answer": "1900", "doc_id": "P1",
                               "title": "Marlo Vesk"},
                              {"question": "When was Ada Pell born?", "answer": "1890", "doc_id": "P2",
                               "title": "Ada Pell"}]})
    gold = {**GOLD, "P2": Document.from_parts("P2", "Ada Pell", "Ada Pell was born in 1890.")}
    assert agent_steps(comparison, {}, gold, restate=True)[-1].thought.endswith(comparison.question)
    for grounded in (True, False):
        base = baseline_steps(q, grounded=grounded)[0].thought
        assert baseline_steps(q, grounded=grounded, restate=True)[0].thought == f"{base} {q.question}"


def test_phrasing_rewrites_the_subquery_its_retrieval_and_its_restatement_but_not_the_answers():
    q = _question()
    plain = agent_steps(q, {}, GOLD, topk=3)
    steps = agent_steps(q, {"WHO DIRECTED RED HARBOUR?": OTHER}, GOLD, topk=3, restate=True, phrasing=str.upper)
    assert is_valid_format(steps)
    assert [steps[i].content for i in (0, 2)] == ["WHO DIRECTED RED HARBOUR?", "WHERE WAS MARLO VESK BORN?"]
    assert [steps[i].content for i in (1, 3, 4)] == [plain[i].content for i in (1, 3, 4)]
    assert steps[1].thought.endswith("WHO DIRECTED RED HARBOUR?")
    assert [d.id for d in steps[0].docs] == ["X0", "X1", "W1"]  # documents looked up by the written subquery


def test_plan_thoughts_count_the_searches_left_down_to_the_answer():
    q = _question()
    plain = agent_steps(q, {}, GOLD, topk=3)
    steps = agent_steps(q, {}, GOLD, topk=3, plan=True)
    assert is_valid_format(steps)
    assert [s.content for s in steps] == [s.content for s in plain]
    assert [steps[i].thought for i in (0, 2, 4)] == [f"Two searches to go. {plain[0].thought}",
                                                     f"One search to go. {plain[2].thought}",
                                                     f"No searches to go. {plain[4].thought}"]
    assert [steps[i].thought for i in (1, 3)] == [plain[i].thought for i in (1, 3)]  # subanswers: unchanged
    bridge = Question(id="q3", question="Whose author was born earlier, A or B?", golden_answers=["A"],
                      metadata={"type": "bridge_comparison", "hops": 4, "decomposition": [
                          {"question": f"sub {i}", "answer": f"a{i}", "doc_id": "W1", "title": "t"} for i in range(4)]
                          + [{"question": "Whose author was born earlier, A or B?", "answer": "A", "doc_id": ""}]})
    notes = [s.thought.split(".")[0] for s in agent_steps(bridge, {}, GOLD, plan=True) if s.kind != "subanswer"]
    assert notes == ["Four searches to go, then compare", "Three searches to go, then compare",
                     "Two searches to go, then compare", "One search to go, then compare",
                     "No searches to go, then compare"]
    assert plan_note(9, compare=False) == "9 searches to go."


def test_baselines_have_one_answer_step_and_standard_rag_sees_documents():
    q = _question()
    steps = baseline_steps(q, grounded=True)
    assert [s.kind for s in steps] == ["answer"] and steps[0].content == "Vuzarburg"
    assert "Marlo Vesk was born" in baseline_prompt(q.question, [GOLD["P1"]])
    assert "Documents" not in baseline_prompt(q.question)


def test_weighted_lm_loss_matches_a_hand_computation():
    from prorag.training.lm import weighted_lm_loss

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(11, 4)
            self.head = torch.nn.Linear(4, 11, bias=False)

        def base_model(self, input_ids, attention_mask, use_cache=None):
            assert use_cache is False  # a training forward builds no KV cache
            return type("O", (), {"last_hidden_state": self.emb(input_ids)})

        def get_output_embeddings(self):
            return self.head

    m = Tiny()
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    labels = torch.tensor([[-100, -100, 3, 4, -100]])
    weights = torch.tensor([[0.0, 0.0, 1.0, 5.0, 0.0]])
    loss, n = weighted_lm_loss(m, ids, torch.ones_like(ids), labels, weights)
    logits = m.head(m.emb(ids))[0]
    ce = torch.nn.functional.cross_entropy(logits[[1, 2]], torch.tensor([3, 4]), reduction="none")
    assert n == 2
    assert torch.allclose(loss, (ce[0] * 1 + ce[1] * 5) / 6)


def test_length_grouped_batches_cover_every_sample_once_and_cut_padding():
    import random

    rng = random.Random(1)
    lengths = [rng.randrange(200, 1000) for _ in range(1000)]
    batches = length_grouped_batches(lengths, batch_size=8, seed=3)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000))
    assert len(batches) == 125 and all(len(b) == 8 for b in batches)
    # same seed -> same batches (resume), another seed -> another order
    assert batches == length_grouped_batches(lengths, batch_size=8, seed=3)
    assert batches != length_grouped_batches(lengths, batch_size=8, seed=4)

    def real_share(bs):
        return sum(lengths[i] for b in bs for i in b) / sum(max(lengths[i] for i in b) * len(b) for b in bs)

    random_batches = [list(range(i, i + 8)) for i in range(0, 1000, 8)]  # lengths are random already
    assert real_share(batches) > 0.95 and real_share(random_batches) < 0.8


def test_length_grouped_batches_keep_a_short_last_batch():
    batches = length_grouped_batches([5, 3, 9, 1, 7], batch_size=2, seed=0)
    assert sorted(len(b) for b in batches) == [1, 2, 2]
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]


def test_hop_questions_are_single_hop_reading_samples_of_each_retrieval_hop():
    from prorag.data.sft import hop_questions

    q = _question()
    hops = hop_questions(q)
    gold_hops = [s for s in q.decomposition if s.doc_id]
    assert [h.question for h in hops] == [s.question for s in gold_hops]
    assert [h.golden_answers[0] for h in hops] == [s.answer for s in gold_hops]
    assert all(h.hops == 1 and h.decomposition[0].doc_id == s.doc_id for h, s in zip(hops, gold_hops))
    assert len({h.id for h in hops}) == len(hops) and all(h.id.startswith(q.id + "/hop") for h in hops)
    # the baselines' answer step answers the hop with its sub-answer
    step, = baseline_steps(hops[0], grounded=True)
    assert step.kind == "answer" and step.content == gold_hops[0].answer


def test_single_search_thoughts_are_the_agents_own_for_a_one_hop_question_asking_the_question():
    from prorag.data.sft import single_search_thoughts

    q = Question(id="q7", question="Where was Marlo Vesk born?", golden_answers=["Vuzarburg"],
                 metadata={"type": "compositional", "hops": 1, "decomposition": [
                     {"question": "Where was Marlo Vesk born?", "answer": "Vuzarburg", "answer_aliases": [],
                      "doc_id": "P1", "title": "Marlo Vesk"}]})
    for restate in (False, True):
        for plan in (False, True):
            steps = agent_steps(q, {q.question: [GOLD["P1"]]}, GOLD, topk=1, restate=restate, plan=plan)
            assert single_search_thoughts(q.id, q.question, restate=restate, plan=plan) == \
                tuple(s.thought for s in steps)
