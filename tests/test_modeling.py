"""Tokenizer, model construction, atomic save/load and model identity."""

import json

import pytest
import torch

from prorag import trajectory as T
from prorag.errors import InvalidArgument
from prorag import modeling as M

from tests.conftest import VocabOnly, synthetic_texts


def test_special_tokens_are_single_ids(tiny_policy):
    _, tok = tiny_policy
    for i, t in enumerate(T.CHAT_TOKENS + T.TAGS):
        assert tok.encode(t, add_special_tokens=False) == [i], t
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    # a tag glued to words is never split or merged
    ids = tok.encode("abc</subquery>def<step>\n", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("</subquery>") in ids and tok.convert_tokens_to_ids("<step>") in ids
    assert set(T.TAGS) <= set(map(str, tok.extra_special_tokens))


def test_chat_template_matches_render_prompt(tiny_policy):
    _, tok = tiny_policy
    for q in ["Who founded the city?", "  spaces  and\nnewline ", "é ü 中文?"]:
        msgs = [{"role": "system", "content": T.SYSTEM_PROMPT}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert text + T.STEP_OPEN == T.render_prompt(q)


def test_decode_round_trip(tiny_policy):
    _, tok = tiny_policy
    text = synthetic_texts(3)[0] + " é"
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False,
                      clean_up_tokenization_spaces=False) == text


@pytest.mark.parametrize("text", ["a\nb", "a\n b", "a\n\n  b\n", "\n", " \n\t\nx",
                                  "<subanswer>\nfounded</subanswer>\n<step>\n"])
def test_decode_round_trip_with_newlines(tiny_policy, text):
    _, tok = tiny_policy
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_word_after_newline_is_the_word_after_a_space(tiny_policy):
    # a subanswer copied from a document must be the same ids the document holds
    _, tok = tiny_policy
    in_doc = tok.encode("It was founded by the city", add_special_tokens=False)
    in_answer = tok.encode("<subanswer>\nthe city</subanswer>", add_special_tokens=False)
    assert in_answer[2:-1] == in_doc[-2:]

def test_saved_layout_and_reload(tiny_policy):
    path, tok = tiny_policy
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    model, tok2 = M.load_policy(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.training
    assert model.config.vocab_size == len(tok2) == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert tok2.encode(T.render_prompt("q"), add_special_tokens=False) == tok.encode(T.render_prompt("q"),
                                                                                     add_special_tokens=False)
    assert tok2.chat_template == M.CHAT_TEMPLATE
    # no leftovers of the atomic write beside the model
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_presets_and_config_validation(tiny_policy):
    _, tok = tiny_policy
    tiny = M.build_model("tiny", tok)
    assert M.num_parameters(tiny) < 2_000_000
    assert M.model_config({"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1}).hidden_size == 32
    with pytest.raises(InvalidArgument):
        M.model_config("huge")
    with pytest.raises(InvalidArgument):
        M.model_config({"num_heads": 6, "num_kv_heads": 4})
    with pytest.raises(ValueError):
        M.model_config({"hidden_sise": 3})


def test_small_preset_size():
    """The bench-picked preset: ~8M parameters with an 8k vocabulary."""

    n = M.num_parameters(M.build_model("small", VocabOnly(8192)))
    assert 7.9e6 <= n <= 15e6


def test_add_format_tokens_to_stock_tokenizer(tmp_path):
    # a tokenizer without the tags (like stock Qwen3) gets them added and the model resized
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    model = M.build_model(M.PolicyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              head_dim=16, intermediate_size=64), tok)
    n = M.add_format_tokens(tok, model)
    assert n == len(T.TAGS) + 2  # tags + <think>, </think>
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in T.TAGS)
    assert M.add_format_tokens(tok, model) == 0


def test_train_tokenizer_rejects_tiny_vocab():
    with pytest.raises(InvalidArgument):
        M.train_tokenizer(["a b"], vocab_size=100)


def test_warm_up_learns_the_copy_task_and_reads(tiny_policy, tmp_path):
    from prorag.training.context import local_context
    from prorag.training.warmup import warm_up
    from prorag.data.warmup import Fact

    _, tok = tiny_policy
    # wired for induction: copy lengths vary per batch (4..6), which no fixed offset solves
    model = M.build_model(M.PolicyModelConfig(hidden_size=96, num_layers=2, num_heads=2, num_kv_heads=1,
                                              head_dim=24, intermediate_size=128, rope_theta=10_000.0,
                                              init="induction"), tok)
    docs = {"d1": '"city"\nThe city was founded by the band. The river is in the mountain.',
            "d2": '"film"\nThe film was directed by the president. The album is from the school.',
            "d3": '"school"\nThe school was founded by the president.'}
    facts = [Fact("d1", "Who founded the city?", "the band"), Fact("d2", "Who directed the film?", "the president"),
             Fact("d3", "Who founded the school?", "the president"),
             Fact("d3", "Who was the founder of the school?", "the president")]  # asked two ways: a paraphrase
    # counterfactual rows swap "the band" and "the president" as founders (the pool of "Who founded X?")
    cfg = M.WarmupConfig(copy_steps=150, copy_length=6, copy_min_length=4, copy_mix=2, sentence_steps=3,
                         document_steps=3, retrieved_steps=3, batch_size=16, lr=3e-3, lr_warmup_steps=50,
                         counterfactual=0.5, gap_steps=3, gap_tokens=5, paraphrase_steps=3)
    events = []
    result = warm_up(local_context(tmp_path / "run", cfg, emit=events.append), model, tok, docs, facts, cfg,
                     log_every=1)
    seen = [(e["step"], e["total_steps"]) for e in events if e.get("loss") is not None]
    losses = [e["loss"] for e in events if e.get("loss") is not None]
    assert result.completed and len(losses) == cfg.total_steps == 171 and seen[-1] == (171, 171)
    # the wired model copies from the start (ln 2048 = 7.6 for one that cannot) and the ramped
    # optimiser improves on it instead of erasing it (at a full-size first step it was erased: ~6)
    assert losses[0] < 2.5 and sum(losses[140:150]) / 10 < losses[0], losses[::10]
    assert torch.isfinite(torch.tensor(losses)).all() and not model.training
    assert json.dumps(M.describe_model(model))
    with pytest.raises(InvalidArgument, match="no facts"):
        warm_up(local_context(tmp_path / "none", cfg), model, tok, {}, facts, cfg)
    one_way = M.WarmupConfig(copy_steps=0, sentence_steps=0, document_steps=0, paraphrase_steps=1, batch_size=2)
    with pytest.raises(InvalidArgument, match="nothing to paraphrase"):
        warm_up(local_context(tmp_path / "one-way", one_way), model, tok, docs, facts[:2], one_way)
