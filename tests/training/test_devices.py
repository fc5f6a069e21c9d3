"""Where a stage computes: device / dtype / attention resolution and refusal, batches moved to the model's device,
mixed precision in the one loop (float32 master weights and optimizer state under bf16 autocast), LoRA in float32
over a bf16 base, MFU against the peak of the dtype used, and a GPU out-of-memory turned into a job failure that
names the micro-batch with the last checkpoint intact.

No GPU exists here: CUDA-only conditions (no bf16 on an old card, an out-of-memory error) are produced by
monkeypatching torch's queries or raising torch's own OutOfMemoryError; everything else runs the real path on the
CPU with the device and dtype as parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prorag.config import from_dict
from prorag.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from prorag.training import devices
from prorag.training.context import local_context
from prorag.training.devices import Placement, resolve, to_device
from prorag.training.loop import LoopConfig, run_loop
from prorag.training.run_config import StageRunConfig, TrainRunConfig

CPU_BF16 = Placement(torch.device("cpu"), torch.bfloat16, "sdpa")


def test_auto_on_a_machine_without_a_gpu_is_the_cpu_in_float32_with_sdpa(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = resolve(TrainRunConfig())
    assert (p.device.type, p.dtype, p.attn_implementation) == ("cpu", torch.float32, "sdpa")
    assert not p.mixed
    assert resolve(TrainRunConfig(dtype="bfloat16")).mixed


def test_what_the_machine_cannot_honour_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FailedPrecondition, match="no CUDA device"):
        from_dict(TrainRunConfig, {"device": "cuda"})
    with pytest.raises(FailedPrecondition, match="no CUDA device"):
        from_dict(TrainRunConfig, {"device": "cuda:1"})
    with pytest.raises(InvalidArgument, match="not a device"):
        devices.resolve_device("gpu-please")
    monkeypatch.setattr(devices, "flash_attn_installed", lambda: False)
    with pytest.raises(FailedPrecondition, match="flash-attn package is not installed"):
        from_dict(TrainRunConfig, {"attn_implementation": "flash_attention_2"})
    with pytest.raises(InvalidArgument, match="loss scaler"):
        resolve(TrainRunConfig(dtype="float16"))
    # a card without bf16 (compute capability < 8): simulated, there is no GPU here
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(FailedPrecondition, match="Tesla T4 does not support it"):
        devices.resolve_dtype("bfloat16", torch.device("cuda", 0))
    assert devices.resolve_dtype("auto", torch.device("cuda", 0)) == torch.float32
    monkeypatch.setattr(devices, "flash_attn_installed", lambda: True)
    with pytest.raises(FailedPrecondition, match="CUDA devices only"):
        devices.resolve_attn("flash_attention_2", torch.device("cpu"))


def test_the_fused_head_loss_is_refused_off_cuda_and_without_liger_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FailedPrecondition, match="CUDA devices only"):
        from_dict(TrainRunConfig, {"fused_linear_ce": True})
    assert resolve(TrainRunConfig()).fused_linear_ce is False and resolve(TrainRunConfig()).sum_ce() is None
    # a CUDA device without liger-kernel: simulated, there is no GPU here (nor liger-kernel, a GPU extra)
    monkeypatch.setattr(devices, "resolve_device", lambda spec: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    real_find_spec = devices.importlib.util.find_spec
    monkeypatch.setattr(devices.importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    with pytest.raises(FailedPrecondition, match="liger-kernel package is not installed"):
        resolve(TrainRunConfig(fused_linear_ce=True))


def test_a_trainer_job_asking_for_a_missing_gpu_is_refused_at_submission(monkeypatch):
    from services.trainer.stages import get_stage, load_stage_modules, validate_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    load_stage_modules()
    with pytest.raises(FailedPrecondition, match="no CUDA device"):
        validate_config(get_stage("prm"), {"pairs": "/x.jsonl", "policy_model": "p", "device": "cuda"})


def test_every_training_stage_takes_the_shared_run_fields():
    from services.trainer.stages import get_stage, load_stage_modules

    load_stage_modules()
    for name in ("warmup", "sft", "prm", "rft", "rl", "dpo"):
        cls = get_stage(name).config_cls
        assert issubclass(cls, StageRunConfig), name
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"device", "dtype", "attn_implementation", "gradient_checkpointing", "compile", "seed",
                "checkpoint_every", "log_every", "threads", "tracking"} <= names, name
        if name != "warmup":  # the warm-up's curriculum carries its own learning rate and ramp
            assert issubclass(cls, TrainRunConfig) and {"lr", "warmup_ratio", "weight_decay", "grad_clip"} <= names


@dataclasses.dataclass
class _Batch:
    parts: list
    tokens: int


def test_to_device_moves_every_tensor_of_a_nested_batch_and_leaves_the_rest():
    meta = torch.device("meta")  # a device that exists everywhere, so the move is visible without a GPU
    batch = (torch.ones(2), [torch.zeros(1), 3, "x"], {"a": torch.ones(1)}, _Batch([torch.ones(2)], 5), None)
    moved = to_device(batch, meta)
    assert moved[0].device == meta and moved[1][0].device == meta and moved[2]["a"].device == meta
    assert moved[3].parts[0].device == meta and moved[3].tokens == 5
    assert moved[1][1:] == [3, "x"] and moved[4] is None
    assert batch[0].device.type == "cpu"  # the original is untouched


def _tiny_lm(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64))


def _lm_task(vocab=64, batch=4, T=12):
    from prorag.training.lm import weighted_lm_loss

    def batch_at(i):
        g = torch.Generator().manual_seed(i % 3)
        ids = torch.randint(4, vocab, (batch, T), generator=g)
        return ids, torch.ones_like(ids), ids, torch.ones(batch, T)

    def loss_fn(m, b):
        ids, attn, labels, w = b
        assert ids.device == next(m.parameters()).device  # the loop moved the batch
        hf = m.get_base_model() if hasattr(m, "get_base_model") else m  # a PEFT model's LoRA layers sit inside
        return weighted_lm_loss(hf, ids, attn, labels, w)[0], int(attn.sum())

    return batch_at, loss_fn


def test_bf16_training_keeps_float32_master_weights_and_optimizer_state_and_learns(tmp_path):
    batch_at, loss_fn = _lm_task()
    cfg = LoopConfig(steps=24, lr=1e-2, log_every=8, checkpoint_every=12)
    results = {}
    for name, placement in (("fp32", devices.CPU_FP32), ("bf16", CPU_BF16)):
        model = _tiny_lm()
        events = []
        ctx = local_context(tmp_path / name, cfg, emit=events.append)
        run_loop(ctx, model, batch_at, loss_fn, cfg, placement=placement)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        state = ctx.load_checkpoint(restore_rng=False)
        exp_avg = [v["exp_avg"] for v in state["optimizer"]["state"].values()]
        assert exp_avg and all(t.dtype == torch.float32 for t in exp_avg)
        timed = [e for e in events if e.get("loss") is not None]
        assert timed[0]["metrics"]["dtype"] == placement.dtype_name
        results[name] = [e["loss"] for e in timed]
    for losses in results.values():
        assert losses[-1] < losses[0] - 0.3  # both learn
    # the same task in both precisions lands within bf16's rounding of each other
    assert abs(results["fp32"][-1] - results["bf16"][-1]) < 0.15


def test_the_peak_is_measured_in_the_dtype_the_step_computes_in():
    from prorag.training.flops import _measure, peak_matmul_flops

    _measure.cache_clear()
    fp32 = peak_matmul_flops("cpu", torch.float32, seconds=0.01)
    bf16 = peak_matmul_flops("cpu", torch.bfloat16, seconds=0.01)
    assert fp32 > 0 and bf16 > 0
    assert _measure.cache_info().currsize == 2  # one measurement per dtype, not one shared figure


def test_lora_over_a_bf16_base_trains_float32_adapters_and_leaves_the_base(tmp_path):
    from peft import LoraConfig, get_peft_model

    from prorag.modeling import prepare_for_training

    base = prepare_for_training(_tiny_lm(), CPU_BF16, frozen=True, gradient_checkpointing=True)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(v.dtype == torch.bfloat16 for v in frozen.values())
    assert lora and all(v.dtype == torch.float32 for v in lora.values())
    batch_at, loss_fn = _lm_task()
    cfg = LoopConfig(steps=4, lr=1e-2, checkpoint_every=100, log_every=2)
    run_loop(local_context(tmp_path / "lora", cfg), model, batch_at, loss_fn, cfg, placement=CPU_BF16)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())
    assert any(not torch.equal(after[n], v) for n, v in lora.items())


def test_a_gpu_out_of_memory_fails_the_job_naming_the_micro_batch_and_keeps_the_checkpoint(tmp_path):
    batch_at, loss_fn = _lm_task()

    def oom_at_step_4(m, b):
        if calls.append(1) or len(calls) == 4:
            # torch's own error type, raised here because no GPU exists to run out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss_fn(m, b)

    calls: list[int] = []
    cfg = LoopConfig(steps=6, lr=1e-3, checkpoint_every=2, log_every=1)
    ctx = local_context(tmp_path / "oom", cfg)
    with pytest.raises(ResourceExhausted) as err:
        run_loop(ctx, _tiny_lm(), batch_at, oom_at_step_4, cfg, placement=devices.CPU_FP32)
    msg = str(err.value)
    assert "at step 4/6, micro-batch 3 (4x12)" in msg and "Tried to allocate 2.00 GiB" in msg
    assert "gradient_checkpointing" in msg and "checkpoint is intact" in msg
    state = ctx.load_checkpoint(restore_rng=False)
    assert state["step"] == 2  # the last checkpoint before the failure, readable
    # a resubmitted job resumes from it and finishes
    out = run_loop(local_context(tmp_path / "oom", cfg), _tiny_lm(), batch_at, loss_fn, cfg,
                   placement=devices.CPU_FP32)
    assert out.completed and out.step == 6


def test_the_grpc_error_mapping_turns_an_out_of_memory_into_resource_exhausted():
    import grpc

    from prorag.rpc.grpc_server import _error_status

    code, msg = _error_status(torch.OutOfMemoryError("CUDA out of memory"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "smaller request" in msg


def test_compile_blocks_compiles_each_decoder_block_in_place_keeping_the_state_dict():
    from prorag.training.loop import compile_blocks

    model = _tiny_lm()
    keys = list(model.state_dict())
    assert compile_blocks(model) == 2
    assert list(model.state_dict()) == keys
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers)
