"""Jobs that fit, or a clear refusal: the trainer estimates a training job's memory (weights, gradients, optimizer state
in the job's precision, activations and logits at its micro-batch, LoRA or not, gradient checkpointing or not) against
the GPU it would run on and refuses what cannot fit with FAILED_PRECONDITION, naming the estimate and the launch that
would fit. On this CPU-only machine the GPU is a stand-in of the size of one H100 (80 GB), handed to the check the
way torch would report it; the model is Qwen3-8B's config.json without weights (the estimate reads only its shape)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from prorag.errors import FailedPrecondition
from prorag.training.memory import ModelShape, TrainingJob
from services.trainer import memory_check
from services.trainer.jobs import JobManager
from services.trainer.jobs.admission import Admission
from services.trainer.stages import get_stage, load_stage_modules

REPO = Path(__file__).resolve().parents[3]
#: Qwen/Qwen3-8B's config.json, the fields the estimate reads (the Hugging Face model card's file)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "intermediate_size": 12288, "vocab_size": 151936, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
H100 = ("cuda:0 (NVIDIA H100 80GB HBM3, a stand-in)", 80 * 10 ** 9)


@pytest.fixture
def one_gpu_trainer(tmp_path, monkeypatch):
    """A trainer whose jobs run on one 80 GB GPU, Qwen3-8B's config in its data volume; (model dir, jobs root)."""
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    model = tmp_path / "data" / "models" / "hub" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    monkeypatch.setattr(memory_check, "device_memory", lambda placement: H100)
    load_stage_modules()
    return model, tmp_path / "runs" / "jobs"


def paper_config(name: str, **changes) -> dict:
    return {**json.loads((REPO / "configs" / "paper" / f"{name}.json").read_text()), **changes}


def test_qwen3_8b_by_its_shape():
    """8.19 B parameters (Qwen3-8B's model card), 16 bytes each trained in full, 43.6 M in LoRA r=16 on every
    projection; the parts follow from the settings as the module says."""
    shape = ModelShape.from_config(QWEN3_8B)
    assert round(shape.params / 1e9, 2) == 8.19
    assert shape.lora_params(16, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj") == 43_646_976
    full = TrainingJob(shape, micro_sequences=8, seq_len=4096, gradient_checkpointing=True).estimate()
    assert full.states == shape.params * (4 + 4 + 8 + 2)  # float32 weights, gradients, AdamW; bf16 autocast copies
    assert full.parts["logits"] == 8 * 4096 * 151936 * (2 + 8)
    lora = TrainingJob(shape, micro_sequences=2, seq_len=2048, lora_r=16).estimate()
    assert lora.parts["weights"] == shape.params * 2 + 43_646_976 * 4  # the frozen base in bf16
    assert lora.parts["optimizer"] == 43_646_976 * 8
    # gradient checkpointing keeps each layer's input only
    plain = TrainingJob(shape, micro_sequences=1, seq_len=4096).estimate().parts["activations"]
    ckpt = TrainingJob(shape, micro_sequences=1, seq_len=4096, gradient_checkpointing=True).estimate()
    assert ckpt.parts["activations"] < plain / 10
    # float32 compute: no autocast copies, 4-byte activations
    fp32 = TrainingJob(shape, micro_sequences=1, seq_len=4096, dtype="float32").estimate()
    assert fp32.parts["weights"] == shape.params * 4
    # what FSDP2 needs: the states over more GPUs, the micro-batch on each
    assert full.sharded(80e9) == (4, 3) and full.sharded(141e9)[0] == 2


def test_a_full_parameter_8b_sft_on_one_gpu_is_refused_with_its_estimate(one_gpu_trainer):
    model, jobs = one_gpu_trainer
    admission = Admission(jobs, ["127.0.0.1", "localhost"], {})
    cfg = paper_config("sft", base_model=str(model), retriever="127.0.0.1:50051", dtype="bfloat16")
    with pytest.raises(FailedPrecondition) as e:
        admission.config(get_stage("sft"), cfg)
    msg = str(e.value)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "8.19B parameters, full-parameter" in msg and "micro-batch 8 x 4096 tokens" in msg
    assert "optimizer 65.5" in msg and "NVIDIA H100" in msg and "80.0 GB" in msg
    # the launch that fits, with the exact commands' shape
    assert "multi-GPU launch (FSDP2) over 4 GPUs" in msg and "micro-batches of at most 3 sequence(s)" in msg
    assert "compose.train.yaml" in msg and "trainer-launch sft" in msg and "k8s/training" in msg


def test_the_refusal_comes_before_the_job_is_queued(one_gpu_trainer):
    model, jobs = one_gpu_trainer
    manager = JobManager(jobs, tracking="local", allowed_endpoints=["127.0.0.1", "localhost"])
    manager.start()
    try:
        with pytest.raises(FailedPrecondition, match="would fit with the multi-GPU launch"):
            manager.submit("sft", paper_config("sft", base_model=str(model), retriever="127.0.0.1:50051",
                                               dtype="bfloat16"))
        assert manager.list() == []
    finally:
        manager.stop(10)


def test_a_lora_job_that_fits_is_accepted(one_gpu_trainer):
    """DPO with LoRA on the same 8B model and GPU: the frozen base in bf16 (16.4 GB) and one pair's activations and
    logits fit in 80 GB, so the trainer takes it."""
    model, jobs = one_gpu_trainer
    pairs = jobs.parent.parent / "data" / "pairs.jsonl"
    pairs.write_text("")
    admission = Admission(jobs, ["127.0.0.1", "localhost"], {})
    # dtype: what auto gives on a GPU with bfloat16 (auto is float32 on this CPU-only machine)
    cfg = {"base_model": str(model), "pairs": str(pairs), "batch_size": 8, "grad_accum": 8, "max_len": 2048,
           "lora_r": 16, "dtype": "bfloat16"}
    validated, _, _ = admission.config(get_stage("dpo"), cfg)
    est = memory_check.training_job("dpo", validated).estimate()
    assert est.fits(H100[1]) and 30e9 < est.total < 72e9
    # the same DPO at 8 pairs a micro-batch does not fit, and the refusal says what would
    with pytest.raises(FailedPrecondition, match=r"LoRA r=16 .* gradient_checkpointing=true"):
        admission.config(get_stage("dpo"), {**cfg, "grad_accum": 1})


def test_jobs_on_the_cpu_and_models_without_a_shape_are_not_checked(one_gpu_trainer, monkeypatch):
    model, jobs = one_gpu_trainer
    admission = Admission(jobs, ["127.0.0.1", "localhost"], {})
    cfg = paper_config("sft", base_model=str(model), retriever="127.0.0.1:50051", dtype="bfloat16")
    monkeypatch.setattr(memory_check, "device_memory", lambda placement: None)  # a CPU job
    admission.config(get_stage("sft"), cfg)
    monkeypatch.setattr(memory_check, "device_memory", lambda placement: H100)
    (model / "config.json").write_text(json.dumps({"model_type": "unknown"}))
    admission.config(get_stage("sft"), cfg)  # no shape, no estimate: taken, as before


@pytest.mark.parametrize("stage,fits", [("sft", False), ("prm", False), ("rft", False), ("dpo", False), ("rl", True)])
def test_the_paper_configs_on_one_80gb_gpu(one_gpu_trainer, stage, fits):
    """What docs/DEPLOY.md and docs/TRAINING.md say: configs/paper's full-parameter stages (SFT, PRM, RFT) of
    Qwen3-8B go to the multi-GPU launch; LoRA RL fits the trainer service's one GPU. LoRA DPO at its 4 pairs a
    micro-batch of up to 8192 tokens each does not in the worst case (the logits alone: 99.6 GB); one pair a
    micro-batch (grad_accum 32) does, on the same GPU."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from prorag.training.devices import Placement

    model, _ = one_gpu_trainer
    cls = get_stage(stage).config_cls
    fields = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    values = {**fields, **paper_config(stage), memory_check.STAGES[stage].model_field: str(model)}
    cfg = SimpleNamespace(**values, placement=lambda: Placement(torch.device("cuda", 0), torch.bfloat16, "sdpa"))
    est = memory_check.training_job(stage, cfg).estimate()
    assert est.fits(H100[1]) == fits, est.describe()
    if not fits:
        n, seqs = est.sharded(H100[1])
        assert n <= 8, "the launch on one 8-GPU host fits it"
        if stage == "dpo":
            assert (n, seqs) == (1, 3), "one pair (2 sequences) a micro-batch fits one GPU"


def test_the_trainer_can_be_told_not_to_check(one_gpu_trainer):
    """memory_check=false (TrainerConfig): the estimate is a worst case (every sequence max_len long); an operator
    who knows the data is shorter submits anyway."""
    model, jobs = one_gpu_trainer
    cfg = paper_config("sft", base_model=str(model), retriever="127.0.0.1:50051", dtype="bfloat16")
    Admission(jobs, ["127.0.0.1", "localhost"], {}, memory_check=False).config(get_stage("sft"), cfg)
    from services.trainer.server import TrainerConfig

    assert TrainerConfig().memory_check is True
