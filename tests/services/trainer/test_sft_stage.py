"""The SFT stage through the real job machinery: data built through a live retriever service,
format-aware loss, publication as a versioned model, config refusal naming the field, and
`kill -9` of the trainer mid-training resuming to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prorag.rpc.clients import wait_for_health
from prorag.rpc.clients_trainer import TrainerClient, state_name
from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread, env, free_port, tiny_data

REPO = Path(__file__).resolve().parents[3]



@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft") / "data"
    tiny_data(d)
    with env("PRORAG_DATA", str(d)):
        from prorag_app.embedded import ensure_indexes, ensure_policy_model

        ensure_indexes("tiny")
        BASE["model"] = str(ensure_policy_model("tiny"))
        yield d


@pytest.fixture(scope="module")
def retriever(data_dir):
    from services.retriever.server import RetrieverConfig, start

    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0, http_port=-1), RetrieverConfig(world="tiny")))
    yield f"127.0.0.1:{started.grpc_port}"
    loop.run(started.stop())
    loop.close()


#: the tiny world's embedded base, built once by the data_dir fixture (stages never build a model themselves)
BASE: dict[str, str] = {}


def _config(retriever: str, **kw) -> dict:
    return {"mode": "agent", "world": "tiny", "retriever": retriever, "base_model": BASE["model"], "max_questions": 48,
            "max_steps": 12, "batch_size": 4, "lr": 3e-3, "checkpoint_every": 3, "log_every": 1, "tracking": "local",
            "threads": 1, **kw}


class TrainerProc:
    def __init__(self, home: Path, data: Path):
        self.home, self.data, self.port = home, data, free_port()
        self.proc = None

    def start(self):
        env = dict(os.environ, PRORAG_HOME=str(self.home), PRORAG_DATA=str(self.data), PYTHONUNBUFFERED="1")
        env.pop("PRORAG_RUNS", None)
        log = open(self.home / f"trainer-{time.monotonic_ns()}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", "serve", "trainer",
                                      "--port", str(self.port)],
                                     cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert wait_for_health(f"127.0.0.1:{self.port}", "prorag.v1.Trainer", timeout=90)
        return self

    def kill9(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_bad_sft_config_is_refused_naming_the_field(tmp_path, data_dir, retriever):
    t = TrainerProc(tmp_path, data_dir).start()
    try:
        with TrainerClient(f"127.0.0.1:{t.port}") as c:
            import grpc

            for bad, field in (({"lr": 5.0}, "lr"), ({"mode": "rlhf"}, "mode"), ({"epocs": 1}, "epocs"),
                               ({"base_model": ""}, "base_model"),
                               ({"base_model": str(tmp_path / "no")}, "base_model")):
                with pytest.raises(grpc.RpcError) as ei:
                    c.start("sft", _config(retriever, **bad))
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in ei.value.details()
    finally:
        t.stop()


def test_sft_kill_dash_nine_resumes_to_the_same_weights(tmp_path, data_dir, retriever):
    # uninterrupted reference
    ref = TrainerProc(tmp_path / "ref", data_dir)
    (tmp_path / "ref").mkdir()
    ref.start()
    try:
        with TrainerClient(f"127.0.0.1:{ref.port}") as c:
            c.start("sft", _config(retriever), job_id="ref-run")
            job = c.wait("ref-run", timeout=600)
            assert state_name(job.state) == "SUCCEEDED", job.error
            assert job.metrics["data_samples"] == 48 and job.metrics["final_loss"] > 0
    finally:
        ref.stop()

    home = tmp_path / "killed"
    home.mkdir()
    t = TrainerProc(home, data_dir).start()
    with TrainerClient(f"127.0.0.1:{t.port}") as c:
        c.start("sft", _config(retriever), job_id="kill-run")
        for ev in c.watch("kill-run"):
            if ev.message.startswith("checkpoint saved at step 6"):
                break
    t.kill9()
    t.start()
    try:
        with TrainerClient(f"127.0.0.1:{t.port}") as c:
            job = c.wait("kill-run", timeout=600)
            assert state_name(job.state) == "SUCCEEDED", job.error
            events = [json.loads(l)
                      for l in (home / "runs" / "jobs" / "kill-run" / "events.jsonl").read_text().splitlines()]
            assert any(e.get("message", "").startswith("resumed from step") for e in events)
    finally:
        t.stop()

    a = _weights(data_dir / "models" / "tiny" / "sft" / "ref-run")
    b = _weights(data_dir / "models" / "tiny" / "sft" / "kill-run")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    manifest = json.loads((home / "runs" / "jobs" / "kill-run" / "run" / "manifest.json").read_text())
    assert manifest["stage"] == "sft" and manifest["config"]["mode"] == "agent"


def test_standard_rag_with_hop_samples_also_reads_every_gold_hop(data_dir, retriever):
    """The fair baseline's data: each whole question, plus one sample per gold hop whose documents hold the
    hop's supporting document and whose answer is the hop's sub-answer."""
    from transformers import AutoTokenizer

    from prorag.config import from_dict
    from prorag.data.loaders import load_split
    from prorag import paths
    from services.trainer.stage_sft import SFTConfig, build_samples

    tok = AutoTokenizer.from_pretrained(BASE["model"])
    cfg = from_dict(SFTConfig, _config(retriever, mode="standard_rag", max_questions=12, hop_samples=True))
    with env("PRORAG_DATA", str(data_dir)):
        samples, stats = build_samples(cfg, tok)
        plain, plain_stats = build_samples(from_dict(SFTConfig, _config(retriever, mode="standard_rag",
                                                                        max_questions=12)), tok)
        qs = load_split(paths.world_dir("tiny"), "train")[:12]
    hops = [s for q in qs for s in q.decomposition if s.doc_id]
    assert stats["hop_samples"] == len(hops) and stats["samples"] == 12 + len(hops) - stats["dropped_too_long"]
    assert plain_stats["samples"] == 12 - plain_stats["dropped_too_long"] and plain_stats["hop_samples"] == 0
    texts = [tok.decode(s.token_ids) for s in samples[-len(hops):]]
    for hop, text in zip(hops, texts):
        assert hop.question in text and hop.answer in text and f"(Title: {hop.title})" in text


def test_one_document_hop_samples_hold_their_gold_document_without_searching(data_dir, retriever, monkeypatch):
    """With topk=1 a hop's reading sample holds exactly its gold document, so its sub-question is not searched;
    (On seed 1's world all 26,000 samples were identical to those built with the search, docs/BENCHMARKS.md.)"""
    from transformers import AutoTokenizer

    from prorag.rpc.clients import RetrieverClient
    from prorag.config import from_dict
    from services.trainer.stage_sft import SFTConfig, build_samples

    tok = AutoTokenizer.from_pretrained(BASE["model"])
    searched: list[str] = []
    real = RetrieverClient.search

    def counting(self, queries, *a, **kw):
        searched.extend(queries)
        return real(self, queries, *a, **kw)

    monkeypatch.setattr(RetrieverClient, "search", counting)
    cfg = from_dict(SFTConfig, _config(retriever, mode="standard_rag", max_questions=12, hop_samples=True, topk=1))
    with env("PRORAG_DATA", str(data_dir)):
        samples, stats = build_samples(cfg, tok)
        from prorag import paths
        from prorag.data.loaders import load_split

        qs = load_split(paths.world_dir("tiny"), "train")[:12]
    assert sorted(set(searched)) == sorted({q.question for q in qs})  # whole questions only
    hops = [s for q in qs for s in q.decomposition if s.doc_id]
    assert stats["hop_samples"] == len(hops)
    for hop, s in zip(hops, samples[-len(hops):]):
        text = tok.decode(s.token_ids)
        assert text.count("(Title: ") == 1 and f"(Title: {hop.title})" in text and hop.answer in text


def test_sft_stage_trains_in_bfloat16_on_the_cpu_through_the_gpu_path(tmp_path, data_dir, retriever):
    from prorag.config import from_dict
    from prorag.registry import registry
    from prorag.training.context import local_context
    from services.trainer.stage_sft import SFTConfig, run_sft

    cfg = from_dict(SFTConfig, _config(retriever, max_steps=4, max_questions=16, tracking="", dtype="bfloat16",
                                       gradient_checkpointing=True, publish_name="sft-bf16"))
    events = []
    out = run_sft(local_context(tmp_path / "bf16", cfg, emit=events.append, stage="sft"))
    timed = [e for e in events if e.get("loss") is not None]
    assert {e["metrics"]["dtype"] for e in timed} == {"bfloat16"} and all(e["metrics"]["mfu"] > 0 for e in timed)
    assert out["steps"] == 4 and 0 < out["final_loss"] < float("inf")
    weights = _weights(registry("model", "tiny").resolve(out["model"]))
    assert {v.dtype for v in weights.values()} == {torch.float32}
