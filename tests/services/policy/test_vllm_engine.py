"""VLLMEngine against a fake ``vllm`` module.

This is a mock because no GPU (and no vLLM) exists on the test machines: the fake records
exactly what the engine hands to vLLM (LLM kwargs, TokensPrompt ids, SamplingParams, LoRARequest
ids) and returns RequestOutput-shaped objects, so the calls and the output conversion are checked;
vLLM's own behaviour is not.
"""

import sys
import types
from dataclasses import dataclass, field

import pytest

from prorag.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from prorag.engine import SamplingSpec, derive_seed


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


@dataclass
class FakeLLMEngine:
    model_config: types.SimpleNamespace
    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)

    def add_lora(self, req):
        self.added.append(req)
        return True

    def remove_lora(self, lora_id):
        self.removed.append(lora_id)
        return True


class FakeLLM:
    """Each completion: tokens prompt[-1]+1, +2, ... ; stops on the first stop id it would emit."""

    instances = []
    script = None  # optional override: fn(prompt_ids, sampling_kw, sample_index) -> (ids, finish, stop_reason)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = FakeLLMEngine(types.SimpleNamespace(max_model_len=kwargs.get("max_model_len", 128)))
        self.calls = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        self.calls.append({"prompts": prompts, "sampling_params": sampling_params, "lora_request": lora_request,
                           "use_tqdm": use_tqdm})
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            kw = sp.kw
            comps = []
            for j in range(kw["n"]):
                if FakeLLM.script:
                    ids, finish, reason = FakeLLM.script(p["prompt_token_ids"], kw, j)
                else:
                    ids, finish, reason = [], "length", None
                    for t in range(kw["max_tokens"]):
                        tok = p["prompt_token_ids"][-1] + 1 + t + j
                        ids.append(tok)
                        if tok in kw["stop_token_ids"]:
                            finish, reason = "stop", tok
                            break
                lps = [{t: Logprob(-0.1 * (k + 1), rank=1)} for k, t in enumerate(ids)]
                comps.append(CompletionOutput(j, "", ids, None, lps, finish, reason))
            outs.append(RequestOutput(str(i), p["prompt_token_ids"], comps[::-1]))  # out of index order
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, mod in {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeLLM.instances.clear()
    FakeLLM.script = None
    yield vllm
    FakeLLM.script = None


@pytest.fixture
def engine(fake_vllm, tiny_policy):
    from services.policy.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_policy[0], max_loras=3, max_lora_rank=16, gpu_memory_utilization=0.5,
                      tensor_parallel_size=2, enable_prefix_caching=True, max_model_len=512)


def adapter_dir(root, name):
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


def test_llm_constructed_with_lora_and_raw_logprobs(engine, tiny_policy):
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["model"] == str(tiny_policy[0])
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["max_loras"] == 3 and llm.kwargs["max_lora_rank"] == 16
    assert llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.kwargs["tensor_parallel_size"] == 2
    assert llm.kwargs["enable_prefix_caching"] is True and llm.kwargs["logprobs_mode"] == "raw_logprobs"
    assert engine.max_model_len == 512 and engine.info()["engine"] == "vllm"


def test_max_loras_must_allow_a_swap(fake_vllm, tiny_policy):
    from services.policy.vllm_engine import VLLMEngine

    with pytest.raises(InvalidArgument):
        VLLMEngine(tiny_policy[0], max_loras=1)


def test_generate_passes_ids_and_sampling(engine):
    spec = SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=5, stop_token_ids=(8, 12), seed=42)
    out = engine.generate([[20, 21, 22], [5]], spec)
    call = FakeLLM.instances[-1].calls[-1]
    assert call["prompts"] == [{"prompt_token_ids": [20, 21, 22]}, {"prompt_token_ids": [5]}]
    assert call["lora_request"] is None and call["use_tqdm"] is False
    kws = [sp.kw for sp in call["sampling_params"]]
    for i, kw in enumerate(kws):
        assert kw == {"n": 2, "temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "stop_token_ids": [8, 12],
                      "seed": derive_seed(42, i), "logprobs": 0, "skip_special_tokens": False}
    # conversion: index order restored, logprob of the sampled token, finish and stop id
    a0, a1 = out[0]
    assert a0.token_ids == [23, 24, 25, 26, 27] and a0.finish_reason == "length" and a0.stop_token_id is None
    assert a0.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert a1.token_ids == [24, 25, 26, 27, 28]
    b0 = out[1][0]
    assert b0.token_ids == [6, 7, 8] and b0.finish_reason == "stop" and b0.stop_token_id == 8


def test_explicit_seeds_and_unseeded(engine):
    engine.generate([[1], [2]], SamplingSpec(max_tokens=2), seeds=[5, 0])
    kws = [sp.kw for sp in FakeLLM.instances[-1].calls[-1]["sampling_params"]]
    assert [kw["seed"] for kw in kws] == [5, None]
    engine.generate([[1]], SamplingSpec(max_tokens=2, temperature=0))
    assert FakeLLM.instances[-1].calls[-1]["sampling_params"][0].kw["seed"] is None
    with pytest.raises(InvalidArgument):
        engine.generate([[1]], SamplingSpec(), seeds=[1, 2])


def test_eos_stop_and_abort_conversion(engine):
    eos = engine.tokenizer.eos_token_id
    FakeLLM.script = lambda p, kw, j: ([30, eos], "stop", None)  # EOS: vLLM leaves stop_reason None
    s = engine.generate([[1]], SamplingSpec(max_tokens=4, stop_token_ids=(9,)))[0][0]
    assert s.finish_reason == "stop" and s.stop_token_id == eos and s.token_ids == [30, eos]
    FakeLLM.script = lambda p, kw, j: ([30], "abort", None)
    with pytest.raises(Unavailable):
        engine.generate([[1]], SamplingSpec(max_tokens=4))


def test_prompt_validation(engine):
    with pytest.raises(InvalidArgument):
        engine.generate([[]], SamplingSpec())
    with pytest.raises(InvalidArgument):
        engine.generate([[1] * 512], SamplingSpec())
    with pytest.raises(InvalidArgument):
        engine.generate([[len(engine.tokenizer)]], SamplingSpec())


def test_adapters_get_fresh_ids_and_switch(engine, tmp_path):
    d1, d2, d3 = adapter_dir(tmp_path, "v1"), adapter_dir(tmp_path, "v2"), adapter_dir(tmp_path, "v1b")
    llm = FakeLLM.instances[-1]
    engine.load_adapter("policy@v1", str(d1))
    engine.load_adapter("policy@v1", str(d1))  # idempotent: no second add_lora
    engine.load_adapter("policy@v2", str(d2))
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in llm.llm_engine.added] == \
           [("policy@v1", 1, str(d1.resolve())), ("policy@v2", 2, str(d2.resolve()))]
    assert engine.adapters() == ["policy@v1", "policy@v2"]

    engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="policy@v1")
    assert llm.calls[-1]["lora_request"].lora_int_id == 1
    engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="policy@v2")
    assert llm.calls[-1]["lora_request"].lora_int_id == 2
    engine.generate([[3]], SamplingSpec(max_tokens=1))
    assert llm.calls[-1]["lora_request"] is None

    with pytest.raises(AlreadyExists):
        engine.load_adapter("policy@v1", str(d3))
    engine.unload_adapter("policy@v1")
    assert llm.llm_engine.removed == [1]
    # the same key with new contents gets a new id: vLLM never serves stale cached weights
    engine.load_adapter("policy@v1", str(d3))
    assert engine.adapter_id("policy@v1") == 3
    engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="policy@v1")
    assert llm.calls[-1]["lora_request"].lora_int_id == 3 and llm.calls[-1]["lora_request"].lora_path == str(d3.resolve())


def test_adapter_errors(engine, tmp_path):
    with pytest.raises(NotFound):
        engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="nope")
    with pytest.raises(NotFound):
        engine.unload_adapter("nope")
    with pytest.raises(NotFound):
        engine.load_adapter("x", str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    with pytest.raises(InvalidArgument):
        engine.load_adapter("x", str(tmp_path / "half"))
    assert FakeLLM.instances[-1].llm_engine.added == []


def test_rollout_runs_on_the_vllm_engine(engine):
    """The orchestrator only needs the protocol: a scripted one-step answer through the fake."""
    from prorag import trajectory as T
    from prorag.rollout import run_rollouts

    tok = engine.tokenizer
    ids = tok.encode("Easy.", add_special_tokens=False) + [tok.convert_tokens_to_ids("</step>")] + \
        tok.encode("\n", add_special_tokens=False) + [tok.convert_tokens_to_ids("<answer>")] + \
        tok.encode("\nfour", add_special_tokens=False) + [tok.convert_tokens_to_ids("</answer>")]
    FakeLLM.script = lambda p, kw, j: (ids, "stop", ids[-1])
    res = run_rollouts(engine, tok, [("q", "Two plus two?")], SamplingSpec(n=2, max_tokens=50, seed=1),
                       lambda qs, k: [[] for _ in qs])
    assert [r.answer for r in res] == ["four", "four"] and all(r.format_valid for r in res), res[0]
    assert T.is_valid_format(res[0].steps)
