"""TransformersEngine on a tiny random Qwen3: batching, stops, raw and tempered logprobs, seeds, LoRA adapters."""

import dataclasses
import threading

import pytest
import torch

from prorag.engine import GeneratedSeq, SamplingSpec, derive_seed
from prorag.errors import AlreadyExists, InvalidArgument, NotFound
from services.policy.compiled_decode import GQA_DECODE_ATTENTION, batch_bucket, use_gqa_decode_attention
from services.policy.engine import TransformersEngine
from services.policy.prefix_cache import PrefixKVCache
from services.policy.sampling import sample_tokens, top_p_filter

GREEDY = SamplingSpec(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def prompts(tiny_policy):
    _, tok = tiny_policy
    texts = ["Who founded the city?", "A", "The river was born in the school during the first years of the band"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def full_logprobs(model, prompt, gen):
    """Reference: log-softmax of one unpadded forward pass at the generated positions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)


def test_shapes_and_lengths(tiny_engine, prompts):
    out = tiny_engine.generate(prompts, SamplingSpec(n=3, temperature=1.0, max_tokens=10, seed=1))
    assert len(out) == len(prompts) and all(len(r) == 3 for r in out)
    for r in out:
        for s in r:
            assert isinstance(s, GeneratedSeq)
            assert len(s.token_ids) == len(s.logprobs) == 10 or s.finish_reason == "stop"
            assert s.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in s.logprobs)


def test_greedy_is_deterministic_and_batch_independent(tiny_engine, prompts):
    a = tiny_engine.generate(prompts, GREEDY)
    b = tiny_engine.generate(prompts, GREEDY)
    alone = [tiny_engine.generate([p], GREEDY)[0] for p in prompts]
    assert [r[0].token_ids for r in a] == [r[0].token_ids for r in b] == [r[0].token_ids for r in alone]


def test_static_and_dynamic_cache_agree(tiny_policy, tiny_engine, prompts):
    dyn = TransformersEngine(tiny_policy[0], cache="dynamic", model=tiny_engine.base, tokenizer=tiny_policy[1])
    assert [r[0].token_ids for r in dyn.generate(prompts, GREEDY)] == \
           [r[0].token_ids for r in tiny_engine.generate(prompts, GREEDY)]


def test_max_tokens_gives_length(tiny_engine, prompts):
    out = tiny_engine.generate(prompts, SamplingSpec(temperature=0, max_tokens=5))
    for r in out:
        assert r[0].finish_reason == "length" and len(r[0].token_ids) == 5 and r[0].stop_token_id is None


def test_stops_on_stop_token_per_sequence(tiny_engine, prompts):
    ref = [r[0].token_ids for r in tiny_engine.generate(prompts, GREEDY)]
    # stop on a token that the first prompt generates mid-way: that row stops there, the others go on
    stop = ref[0][6]
    first = ref[0].index(stop)
    out = tiny_engine.generate(prompts, SamplingSpec(temperature=0, max_tokens=24, stop_token_ids=(stop,)))
    s0 = out[0][0]
    assert s0.token_ids == ref[0][:first + 1] and s0.finish_reason == "stop" and s0.stop_token_id == stop
    for r, full in zip(out[1:], ref[1:]):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert r[0].token_ids == full[:cut]  # rows finishing at other times are unaffected


@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_finished_rows_get_no_tokens_whether_or_not_compacted(tiny_policy, tiny_engine, prompts, compact_below):
    # regression: a row that stopped while its slot was kept (no compaction yet) went on generating
    eng = TransformersEngine(tiny_policy[0], compact_below=compact_below, model=tiny_engine.base,
                             tokenizer=tiny_policy[1])
    ref = [r[0].token_ids for r in eng.generate(prompts, GREEDY)]
    stop = ref[0][3]
    out = eng.generate(prompts * 3, SamplingSpec(temperature=0, max_tokens=24, stop_token_ids=(stop,)))
    for r, full in zip(out, ref * 3):
        s = r[0]
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert s.token_ids == full[:cut] and len(s.logprobs) == len(s.token_ids)
        assert (s.finish_reason == "stop") == (stop in full)


def test_eos_always_stops(tiny_engine, prompts):
    # force EOS as the most likely token: a huge bias on its logit via a hook on the LM head
    eos = tiny_engine.eos_id
    h = tiny_engine.base.lm_head.register_forward_hook(
        lambda m, i, o: o.index_fill(-1, torch.tensor([eos]), 1e4))
    try:
        out = tiny_engine.generate(prompts[:1], GREEDY)
    finally:
        h.remove()
    assert out[0][0].token_ids == [eos] and out[0][0].finish_reason == "stop" and out[0][0].stop_token_id == eos


def test_logprobs_match_full_forward(tiny_engine, prompts):
    out = tiny_engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, top_p=0.9, max_tokens=20, seed=5))
    for p, r in zip(prompts, out):
        for s in r:
            ref = full_logprobs(tiny_engine.base, p, s.token_ids)
            assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4)


def test_tempered_logprobs_are_those_of_the_distribution_sampled_from(tiny_engine, prompts):
    """Asked for tempered log-probs the engine returns log-softmax(top_p(logits / T)) of each drawn token, the
    same tokens as a raw call with the same seed; greedy decoding returns raw ones either way."""
    spec = SamplingSpec(n=2, temperature=0.6, top_p=0.95, max_tokens=20, seed=5)
    raw = tiny_engine.generate(prompts, spec)
    tempered = tiny_engine.generate(prompts, dataclasses.replace(spec, tempered_logprobs=True))
    moved = 0
    for p, r_raw, r_t in zip(prompts, raw, tempered):
        for a, b in zip(r_raw, r_t):
            assert a.token_ids == b.token_ids  # the kind of log-probs never changes the draw
            with torch.no_grad():
                logits = tiny_engine.base(torch.tensor([p + b.token_ids])).logits[0].float()
            dist = torch.log_softmax(top_p_filter(logits / 0.6, 0.95), -1)[len(p) - 1:-1]
            ref = dist.gather(-1, torch.tensor(b.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(b.logprobs), atol=1e-4)
            moved += sum(abs(x - y) > 1e-3 for x, y in zip(a.logprobs, b.logprobs))
    assert moved > 10  # the two kinds differ at this temperature: the check above could fail
    greedy = dataclasses.replace(GREEDY, tempered_logprobs=True)
    assert tiny_engine.generate(prompts, greedy) == tiny_engine.generate(prompts, GREEDY)


def test_seeds_reproduce_and_differ(tiny_engine, prompts):
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=11)
    a = tiny_engine.generate(prompts, spec)
    b = tiny_engine.generate(prompts, spec)
    assert [[s.token_ids for s in r] for r in a] == [[s.token_ids for s in r] for r in b]
    assert a[0][0].token_ids != a[0][1].token_ids  # samples of one prompt differ
    c = tiny_engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=12))
    assert [[s.token_ids for s in r] for r in a] != [[s.token_ids for s in r] for r in c]
    # explicit per-prompt seeds: a prompt's samples do not depend on its batch-mates
    both = tiny_engine.generate(prompts[:2], spec, seeds=[7, 8])
    alone = tiny_engine.generate(prompts[1:2], spec, seeds=[8])
    assert [s.token_ids for s in both[1]] == [s.token_ids for s in alone[0]]


def test_unseeded_samples_vary(tiny_engine, prompts):
    out = tiny_engine.generate([prompts[0]], SamplingSpec(n=4, temperature=1.0, max_tokens=12))
    assert len({tuple(s.token_ids) for s in out[0]}) > 1


def test_chunking(tiny_policy, tiny_engine, prompts):
    small = TransformersEngine(tiny_policy[0], max_batch_size=2, model=tiny_engine.base, tokenizer=tiny_policy[1])
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=8, seed=3)
    assert [[s.token_ids for s in r] for r in small.generate(prompts, spec)] == \
           [[s.token_ids for s in r] for r in tiny_engine.generate(prompts, spec)]


def test_context_limit_and_bad_input(tiny_engine, prompts):
    limit = tiny_engine.max_model_len
    near = (prompts[2] * 100)[:limit - 3]
    out = tiny_engine.generate([near], GREEDY)
    assert len(out[0][0].token_ids) <= 3 and (out[0][0].finish_reason == "length" or out[0][0].stop_token_id)
    with pytest.raises(InvalidArgument):
        tiny_engine.generate([(prompts[2] * 100)[:limit]], GREEDY)
    with pytest.raises(InvalidArgument):
        tiny_engine.generate([[]], GREEDY)
    with pytest.raises(InvalidArgument):
        tiny_engine.generate([[tiny_engine.vocab_size]], GREEDY)
    with pytest.raises(InvalidArgument):
        tiny_engine.generate(prompts, SamplingSpec(top_p=0))
    with pytest.raises(InvalidArgument):
        tiny_engine.generate(prompts, SamplingSpec(n=0))
    with pytest.raises(InvalidArgument):
        tiny_engine.generate(prompts, SamplingSpec(), seeds=[1])
    with pytest.raises(NotFound):
        tiny_engine.generate(prompts, GREEDY, adapter="nope@v1")


def test_sampling_helpers():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    kept = top_p_filter(logits, 0.5)
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()
    g = [torch.Generator().manual_seed(1)]
    assert sample_tokens(kept, 1.0, 1.0, g).tolist() == [1]
    assert sample_tokens(logits, 0.0, 1.0).tolist() == [1]
    draws = sample_tokens(logits.expand(4000, 4), 1.0, 1.0)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    assert derive_seed(0, 3) == 0 and derive_seed(5, 3) != derive_seed(5, 4) and derive_seed(5, 3) > 0


# --- LoRA ------------------------------------------------------------------------------------

def make_adapter(model_dir, out_dir, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,  # random A and B: a visible change
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(base, cfg)
    peft_model.save_pretrained(str(out_dir))
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    m1 = make_adapter(tiny_policy[0], root / "a1", seed=1)
    m2 = make_adapter(tiny_policy[0], root / "a2", seed=2)
    return {"a1": (root / "a1", m1), "a2": (root / "a2", m2)}


@pytest.fixture(params=[False, True], ids=["peft-layers", "merged"])
def lora_engine(tiny_policy, request):
    """Both ways of running an adapter: PEFT's LoRA layers on the shared base, and a merged copy per adapter."""
    return TransformersEngine(tiny_policy[0], max_batch_size=8, merge_adapters=request.param)


def test_lora_changes_outputs_and_base_stays(lora_engine, adapters, prompts):
    base_before = lora_engine.generate(prompts, GREEDY)
    lora_engine.load_adapter("policy@v1", str(adapters["a1"][0]))
    lora_engine.load_adapter("policy@v1", str(adapters["a1"][0]))  # same key, same path: no-op
    assert lora_engine.adapters() == ["policy@v1"]
    with_a1 = lora_engine.generate(prompts, GREEDY, adapter="policy@v1")
    base_after = lora_engine.generate(prompts, GREEDY, adapter=None)
    assert [r[0].token_ids for r in with_a1] != [r[0].token_ids for r in base_before]
    assert [r[0].token_ids for r in base_after] == [r[0].token_ids for r in base_before]
    for a, b in zip(base_after, base_before):
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-5)
    # the engine's adapter output is the PEFT model's own forward
    ref = full_logprobs(adapters["a1"][1], prompts[0], with_a1[0][0].token_ids)
    assert torch.allclose(ref, torch.tensor(with_a1[0][0].logprobs), atol=1e-4)


def test_switching_adapters_between_calls(lora_engine, adapters, prompts):
    lora_engine.load_adapter("policy@v1", str(adapters["a1"][0]))
    lora_engine.load_adapter("policy@v1.2", str(adapters["a2"][0]))  # a "." in the key is fine
    r1 = lora_engine.generate(prompts, GREEDY, adapter="policy@v1")
    r2 = lora_engine.generate(prompts, GREEDY, adapter="policy@v1.2")
    r1b = lora_engine.generate(prompts, GREEDY, adapter="policy@v1")
    assert [r[0].token_ids for r in r1] != [r[0].token_ids for r in r2]
    assert [r[0].token_ids for r in r1] == [r[0].token_ids for r in r1b]
    ref = full_logprobs(adapters["a2"][1], prompts[1], r2[1][0].token_ids)
    assert torch.allclose(ref, torch.tensor(r2[1][0].logprobs), atol=1e-4)
    base = lora_engine.generate(prompts, GREEDY)
    lora_engine.unload_adapter("policy@v1")
    assert lora_engine.adapters() == ["policy@v1.2"]
    assert [r[0].token_ids for r in lora_engine.generate(prompts, GREEDY, adapter="policy@v1.2")] == \
           [r[0].token_ids for r in r2]
    lora_engine.unload_adapter("policy@v1.2")
    assert [r[0].token_ids for r in lora_engine.generate(prompts, GREEDY)] == [r[0].token_ids for r in base]
    with pytest.raises(NotFound):
        lora_engine.unload_adapter("policy@v1")
    # and loading again after everything was unloaded works
    lora_engine.load_adapter("policy@v3", str(adapters["a1"][0]))
    assert [r[0].token_ids for r in lora_engine.generate(prompts, GREEDY, adapter="policy@v3")] == \
           [r[0].token_ids for r in r1]


def test_adapter_validation(lora_engine, adapters, tmp_path):
    with pytest.raises(NotFound):
        lora_engine.load_adapter("x", str(tmp_path / "missing"))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidArgument):
        lora_engine.load_adapter("x", str(tmp_path / "partial"))
    lora_engine.load_adapter("k", str(adapters["a1"][0]))
    with pytest.raises(AlreadyExists):
        lora_engine.load_adapter("k", str(adapters["a2"][0]))
    assert lora_engine.info()["adapters"] == ["k"]


def test_unload_waits_for_in_flight_generation(lora_engine, adapters, prompts):
    """A swap never lands mid-batch: the generation in flight finishes on the adapter it started with."""
    lora_engine.load_adapter("v1", str(adapters["a1"][0]))
    expected = lora_engine.generate(prompts, SamplingSpec(temperature=0, max_tokens=60), adapter="v1")
    started = threading.Event()
    hook = lora_engine.weights.model_for("v1").register_forward_pre_hook(lambda *a: started.set())
    result = {}

    def run():
        result["out"] = lora_engine.generate(prompts, SamplingSpec(temperature=0, max_tokens=60), adapter="v1")

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    hook.remove()
    lora_engine.unload_adapter("v1")  # blocks until the batch is done
    t.join(60)
    assert [r[0].token_ids for r in result["out"]] == [r[0].token_ids for r in expected]
    assert lora_engine.adapters() == []


# --- prefix KV reuse -------------------------------------------------------------------------

def test_prefix_cache_unit():
    def kv(n):
        return [torch.zeros(2, n, 4)], [torch.zeros(2, n, 4)]  # 2 * 2*n*4 floats * 4 bytes

    c = PrefixKVCache(max_bytes=2 * 2 * 10 * 4 * 4)  # room for 10 tokens
    c.put(None, [1, 2, 3], *kv(3))
    c.put(None, [1, 2, 3, 4, 5], *kv(5))
    c.put("v1", [1, 2], *kv(2))
    assert c.longest_prefix(None, [1, 2, 3, 4, 5, 6], 5).ids == (1, 2, 3, 4, 5)
    assert c.longest_prefix(None, [1, 2, 3, 4, 5, 6], 4).ids == (1, 2, 3)
    assert c.longest_prefix(None, [1, 2, 9, 9], 3) is None
    assert c.longest_prefix("v1", [1, 2, 3], 2).ids == (1, 2)
    c.put(None, [7, 7, 7], *kv(3))  # over budget: the least recently used entry goes
    assert c.longest_prefix(None, [1, 2, 3, 4, 5, 6], 5).ids == (1, 2, 3) and len(c) == 3
    c.drop_adapter(None)
    assert len(c) == 1 and c.longest_prefix("v1", [1, 2, 3], 2) is not None
    c.clear()
    assert len(c) == 0 and c.bytes == 0


@pytest.fixture(scope="module")
def uncached(tiny_policy, tiny_engine):
    return TransformersEngine(tiny_policy[0], prefix_cache_bytes=0, model=tiny_engine.base,
                              tokenizer=tiny_policy[1])


def test_prefix_reuse_matches_full_prefill(tiny_policy, tiny_engine, uncached, prompts):
    tok = tiny_policy[1]
    engine = TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tok, max_batch_size=8)
    first = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=4))
    assert engine.info()["prefix_cache_entries"] == 6
    glue = tok.encode("\n<retrieval>\nDoc 1(Title: A) some text\n</retrieval>\n<step>\n", add_special_tokens=False)
    # next round: each sequence plus glue, mixed with a brand-new prompt and a repeated one
    nxt = [p + s.token_ids + glue for p, r in zip(prompts, first) for s in r] + [prompts[1] + glue, prompts[0]]
    spec = SamplingSpec(temperature=1.0, top_p=0.95, max_tokens=16, seed=8)
    before = dict(engine.stats)
    got = engine.generate(nxt, spec)
    ref = uncached.generate(nxt, spec)
    reused = engine.stats["reused_tokens"] - before["reused_tokens"]
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    assert reused >= sum(len(p) for p in prompts) * 2 and reused + prefilled == sum(len(p) for p in nxt)
    for g, r in zip(got, ref):
        assert g[0].token_ids == r[0].token_ids
        assert g[0].logprobs == pytest.approx(r[0].logprobs, abs=1e-4)
    # and the logprobs are still those of one full forward pass
    for p, g in zip(nxt, got):
        assert torch.allclose(full_logprobs(engine.base, p, g[0].token_ids), torch.tensor(g[0].logprobs), atol=1e-4)


def test_identical_prompts_prefill_once(tiny_policy, tiny_engine, prompts):
    engine = TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tiny_policy[1],
                                prefix_cache_bytes=0)
    engine.generate([prompts[2]] * 3, SamplingSpec(n=4, max_tokens=2, seed=1))
    assert engine.stats["prefill_tokens"] == len(prompts[2])


def test_prefix_cache_is_per_adapter(tiny_policy, adapters, uncached, prompts):
    tok = tiny_policy[1]
    engine = TransformersEngine(tiny_policy[0], max_batch_size=8)
    engine.load_adapter("v1", str(adapters["a1"][0]))
    out = engine.generate(prompts, GREEDY, adapter="v1")
    nxt = [p + r[0].token_ids + tok.encode("\n<step>\n", add_special_tokens=False) for p, r in zip(prompts, out)]
    before = engine.stats["reused_tokens"]
    base = engine.generate(nxt, GREEDY)  # the adapter's KV must not leak into the base model
    assert engine.stats["reused_tokens"] == before
    assert [r[0].token_ids for r in base] == [r[0].token_ids for r in uncached.generate(nxt, GREEDY)]
    engine.generate(nxt, GREEDY, adapter="v1")
    assert engine.stats["reused_tokens"] > before
    engine.unload_adapter("v1")
    assert engine.info()["prefix_cache_entries"] == len(prompts)  # only the base entries are left


# --- compiled decoding (compile_decode) ------------------------------------------------------
# torch.compile with the "aot_eager" backend: the same dynamo capture and graph as inductor, without the C++ codegen
# that takes ~45 s on 2 cores for this model; the GPU's inductor + CUDA graphs path is the same engine code.

COMPILED = {"compile_decode": "on", "compile_backend": "aot_eager"}


def tokens(out):
    return [[s.token_ids for s in r] for r in out]


def assert_same(got, ref):
    assert tokens(got) == tokens(ref)
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            assert (a.finish_reason, a.stop_token_id) == (b.finish_reason, b.stop_token_id)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def compiled_engine(tiny_policy, tiny_engine):
    return TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tiny_policy[1], max_batch_size=16,
                              **COMPILED)


def test_compile_decode_option(tiny_policy, tiny_engine):
    def make(**kw):
        return TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tiny_policy[1], **kw)

    assert make().compile_decode is False  # auto: on for CUDA devices only
    assert make(compile_decode="on").compile_decode is True
    assert make(compile_decode="off").compile_decode is False
    assert make(compile_decode="on", cache="dynamic").compile_decode is False  # graphs need the static cache
    with pytest.raises(InvalidArgument):
        make(compile_decode="yes")
    with pytest.raises(InvalidArgument):
        make(stop_check_every=0)


def test_batch_bucket():
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert [batch_bucket(n, 100) for n in (60, 64, 65, 100)] == [64, 64, 100, 100]  # never past the chunk size
    assert all(batch_bucket(n, cap) >= n for cap in (1, 7, 48) for n in range(1, cap + 1))


@pytest.mark.parametrize("spec", [GREEDY, SamplingSpec(n=3, temperature=1.0, max_tokens=20, seed=3),
                                  SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=12, seed=9),
                                  SamplingSpec(n=2, temperature=0.7, max_tokens=12, seed=9, tempered_logprobs=True)],
                         ids=["greedy", "seeded", "top-p", "tempered"])
def test_compiled_decode_matches_eager(tiny_engine, compiled_engine, prompts, spec):
    before = compiled_engine.stats["compiled_steps"]
    assert_same(compiled_engine.generate(prompts, spec), tiny_engine.generate(prompts, spec))
    assert compiled_engine.stats["compiled_steps"] > before  # the compiled step ran, not a silent fallback
    # explicit seeds: a row's samples still depend on its own seed only
    if spec.temperature:
        assert tokens(compiled_engine.generate(prompts[1:2], spec, seeds=[8])) == \
               tokens(tiny_engine.generate(prompts[:2], spec, seeds=[7, 8]))[1:]


@pytest.mark.parametrize("compact_below,check_every", [(0.0, 1), (0.75, 5), (1.0, 3)])
def test_compiled_decode_stops_and_compaction(tiny_policy, tiny_engine, prompts, compact_below, check_every):
    """Rows stopping at different steps, read back every few steps, compacted into smaller batch buckets."""
    eng = TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tiny_policy[1],
                             compact_below=compact_below, stop_check_every=check_every, **COMPILED)
    free = SamplingSpec(n=2, temperature=1.0, max_tokens=24, seed=2)
    ref = tokens(tiny_engine.generate(prompts, free))
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=24, seed=2, stop_token_ids=(ref[0][0][3], ref[2][1][9]))
    got = eng.generate(prompts * 3, spec)
    assert_same(got, tiny_engine.generate(prompts * 3, spec))
    assert any(s.finish_reason == "stop" for r in got for s in r) and any(s.finish_reason == "length" for r in got
                                                                          for s in r)


def test_compiled_decode_reuses_prefixes_and_its_cache_memory(tiny_policy, tiny_engine, uncached, prompts):
    tok = tiny_policy[1]
    eng = TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tok, max_batch_size=8, **COMPILED)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=4)
    first = eng.generate(prompts, spec)
    assert_same(first, uncached.generate(prompts, spec))
    pool = {key: t.data_ptr() for key, t in eng.compiled.kv_pool._flat.items()}
    glue = tok.encode("\n<retrieval>\nDoc 1(Title: A) some text\n</retrieval>\n<step>\n", add_special_tokens=False)
    nxt = [p + s.token_ids + glue for p, r in zip(prompts, first) for s in r]
    before = eng.stats["reused_tokens"]
    assert_same(eng.generate(nxt, spec), uncached.generate(nxt, spec))
    assert eng.stats["reused_tokens"] - before >= sum(len(p) for p in prompts) * 2
    # the same cache memory served both calls: a CUDA graph keeps replaying on the addresses it recorded
    assert {key: t.data_ptr() for key, t in eng.compiled.kv_pool._flat.items()} == pool


@pytest.mark.parametrize("merge", [False, True], ids=["peft-layers", "merged"])
def test_compiled_decode_with_adapters(tiny_policy, adapters, prompts, merge):
    eager = TransformersEngine(tiny_policy[0], max_batch_size=8, merge_adapters=merge)
    comp = TransformersEngine(tiny_policy[0], max_batch_size=8, merge_adapters=merge, **COMPILED)
    for eng in (eager, comp):
        eng.load_adapter("v1", str(adapters["a1"][0]))
        eng.load_adapter("v2", str(adapters["a2"][0]))
    for adapter in ("v1", "v2", None, "v1"):
        assert_same(comp.generate(prompts, GREEDY, adapter=adapter), eager.generate(prompts, GREEDY, adapter=adapter))
    comp.unload_adapter("v2")
    eager.unload_adapter("v2")
    assert_same(comp.generate(prompts, GREEDY, adapter="v1"), eager.generate(prompts, GREEDY, adapter="v1"))
    assert comp.stats["compiled_steps"] > 0
    assert len(comp.compiled.steps) == (2 if merge else 1)  # the unloaded copy's compiled step is gone


def test_compiled_decode_failure_falls_back(tiny_policy, tiny_engine, prompts, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no graphs today")

    eng = TransformersEngine(tiny_policy[0], model=tiny_engine.base, tokenizer=tiny_policy[1],
                             compile_decode="on", compile_backend=broken_backend)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=10, seed=6)
    with caplog.at_level("WARNING", logger="prorag.policy.engine"):
        got = eng.generate(prompts, spec)
    assert_same(got, tiny_engine.generate(prompts, spec))  # the request is served, by the eager step
    assert "decoding uncompiled" in caplog.text and "no graphs today" in caplog.text
    assert eng.stats["compiled_steps"] == 0 and eng.compiled.steps[id(eng.base)][1] is None


def test_gqa_decode_attention_matches_repeated_kv(tiny_policy):
    """The one-token GQA attention that compile_decode switches sdpa models to, against transformers' eager attention
    (K and V repeated to every query head), on a left-padded batch decoding from a static cache."""
    from transformers import AutoModelForCausalLM, StaticCache

    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    logits = {}
    for impl in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_policy[0]), attn_implementation=impl).eval()
        if impl == "sdpa":
            use_gqa_decode_attention(model)
            assert model.config._attn_implementation == GQA_DECODE_ATTENTION
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads: the case at issue
        cache = StaticCache(config=model.config, max_cache_len=12)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            full = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1)
            logits[impl] = model(input_ids=torch.tensor([[3], [4]]), attention_mask=full, position_ids=pos[:, -1:] + 1,
                                 past_key_values=cache).logits
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=1e-5)
