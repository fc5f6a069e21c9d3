"""The one training loop: exact resume, gradient accumulation, cancellation, progress events with tokens/s and MFU."""

import gc
import math
import threading
import weakref

import pytest
import torch

from prorag.config import ConfigError, from_dict
from prorag.training import checkpoint
from prorag.training.context import local_context
from prorag.training.flops import peak_matmul_flops
from prorag.training.loop import LoopConfig, _LossModule, attach_engine, call_in_engine, run_loop

N, DIM = 64, 4


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return x, x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)


def _batches(size: int):
    x, y = _data()

    def batch_at(i: int):
        rows = [(i * size + j) % N for j in range(size)]
        return x[rows], y[rows]
    return batch_at


def mse(model, batch):
    xb, yb = batch
    return torch.nn.functional.mse_loss(model(xb), yb), len(xb)


def noise(model):
    for p in model.parameters():  # from the global RNG: an exact resume has to restore it
        p.grad.add_(0.01 * torch.randn_like(p.grad))


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, 1)


CFG = LoopConfig(steps=20, optimizer="adamw", lr=0.05, weight_decay=0.01, schedule="warmup_cosine", warmup_steps=3,
                 grad_clip=1.0, checkpoint_every=5, log_every=1)


def _train(work, cfg=CFG, batch_at=None, emit=None, **ctx_kw):
    model = _model()
    ctx = local_context(work, cfg, emit=emit, **ctx_kw)
    result = run_loop(ctx, model, batch_at or _batches(8), mse, cfg, grad_hook=noise)
    return model, result


def _same_weights(a, b, atol=0.0):
    return all(torch.allclose(a.state_dict()[k], b.state_dict()[k], atol=atol, rtol=0) for k in a.state_dict())


def test_resume_after_a_stop_or_a_crash_gives_the_uninterrupted_weights(tmp_path):
    straight, done = _train(tmp_path / "straight")
    assert done.completed and done.step == 20

    # a stop (trainer shutting down) at step 7: checkpoint there, return, resume later
    stop = threading.Event()
    events = []

    def emit(event):
        events.append(event)
        if event.get("step") == 7:
            stop.set()
    _, first = _train(tmp_path / "stopped", emit=emit, stop=stop)
    assert not first.completed and first.step == 7
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "stopped" / "checkpoints")] == [5, 7]
    resumed, second = _train(tmp_path / "stopped", emit=events.append)
    assert second.completed and "resumed from step 7" in [e.get("message") for e in events]
    assert _same_weights(resumed, straight)

    # a crash in step 12 (as a kill -9 would leave it): the next run resumes from the checkpoint at 10
    def failing(i):
        if i == 12:
            raise RuntimeError("killed")
        return _batches(8)(i)
    with pytest.raises(RuntimeError, match="killed"):
        _train(tmp_path / "crashed", batch_at=failing)
    events.clear()
    resumed, _ = _train(tmp_path / "crashed", emit=events.append)
    assert "resumed from step 10" in [e.get("message") for e in events]
    assert _same_weights(resumed, straight)


def test_k_micro_batches_equal_one_k_times_larger_batch(tmp_path):
    accum = from_dict(LoopConfig, {**CFG.__dict__, "grad_accum": 4, "log_every": 5})
    big = from_dict(LoopConfig, {**CFG.__dict__, "log_every": 5})
    seen = {"accum": [], "big": []}
    a = _model()
    run_loop(local_context(tmp_path / "a", accum, emit=seen["accum"].append), a, _batches(4), mse, accum)
    b = _model()
    run_loop(local_context(tmp_path / "b", big, emit=seen["big"].append), b, _batches(16), mse, big)
    assert _same_weights(a, b, atol=1e-6)
    losses = {k: [e["loss"] for e in v if e.get("loss") is not None] for k, v in seen.items()}
    assert losses["accum"] == pytest.approx(losses["big"], rel=1e-5)


def test_cancel_returns_at_once_without_a_checkpoint(tmp_path):
    cancel = threading.Event()

    def emit(event):
        if event.get("step") == 3:
            cancel.set()
    model, result = _train(tmp_path / "c", cfg=from_dict(LoopConfig, {**CFG.__dict__, "steps": 1000}), emit=emit,
                           cancel=cancel)
    assert not result.completed and result.step == 3
    assert checkpoint.list_checkpoints(tmp_path / "c" / "checkpoints") == []
    assert not model.training


def test_progress_events_report_tokens_per_s_and_mfu(tmp_path):
    events = []
    cfg = from_dict(LoopConfig, {**CFG.__dict__, "log_every": 4, "steps": 10})
    _train(tmp_path / "e", cfg=cfg, emit=events.append)
    progress = [e for e in events if e.get("loss") is not None]
    assert [e["step"] for e in progress] == [4, 8, 10] and all(e["total_steps"] == 10 for e in progress)
    peak = peak_matmul_flops()
    assert peak > 1e8  # any CPU does better than 0.1 GFLOP/s on a 1024^3 fp32 matmul
    for e in progress:
        m = e["metrics"]
        assert e["tokens_per_s"] > 0 and m["peak_flops"] == peak
        assert m["mfu"] == pytest.approx(e["tokens_per_s"] * 6 * (DIM + 1) / peak)
        assert m["lr"] > 0 and m["grad_norm"] >= 0
    # the last step (index 9) runs at the cosine's 6/7 point: 3 warm-up steps, then 7 of decay
    assert progress[-1]["metrics"]["lr"] == pytest.approx(0.05 * 0.5 * (1 + math.cos(math.pi * 6 / 7)))


def test_a_local_run_resumes_only_its_own_config(tmp_path):
    _train(tmp_path / "w", emit=None, stop=_stop_at_start())
    assert checkpoint.list_checkpoints(tmp_path / "w" / "checkpoints")  # stopped at step 0 with a checkpoint
    other = from_dict(LoopConfig, {**CFG.__dict__, "lr": 0.01})
    local_context(tmp_path / "w", other)
    assert checkpoint.list_checkpoints(tmp_path / "w" / "checkpoints") == []


def _stop_at_start():
    stop = threading.Event()
    stop.set()
    return stop


def test_loop_config_is_strict():
    with pytest.raises(ConfigError, match="schedule"):
        from_dict(LoopConfig, {"schedule": "linear"})
    with pytest.raises(ConfigError, match="optimizer"):
        from_dict(LoopConfig, {"optimizer": "lion"})
    with pytest.raises(ConfigError, match="grad_accum"):
        from_dict(LoopConfig, {"grad_accum": 0})


def test_a_non_finite_loss_stops_the_loop_before_the_step_is_applied(tmp_path):
    from prorag.training.loop import NonFiniteLoss

    x, y = _data()
    seen = []

    def batch_at(i):
        seen.append(i)
        return x[:8], (y[:8] * float("nan")) if i == 3 else y[:8]

    model = _model()
    ctx = local_context(tmp_path, CFG)
    before = {}

    def hook(m):  # the weights as they were before each step's update
        before.update({k: v.clone() for k, v in m.state_dict().items()})

    with pytest.raises(NonFiniteLoss, match=r"step 4/20: the loss .*not finite.*not applied"):
        run_loop(ctx, model, batch_at, mse, CFG, grad_hook=hook)
    assert seen[-1] == 3
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # step 4 left the weights alone


def test_shuffled_epochs_cover_every_item_once_per_epoch_as_a_function_of_seed_and_step():
    from prorag.training.loop import shuffled_epochs

    items = list(range(10))
    total, batch_at = shuffled_epochs(items, 4, 2.5, seed=3)
    assert total == 8  # 3 batches per epoch x 2.5, rounded
    first = [x for i in range(3) for x in batch_at(i)]
    second = [x for i in range(3, 6) for x in batch_at(i)]
    assert sorted(first) == sorted(second) == items and first != second  # each epoch its own order
    again = shuffled_epochs(items, 4, 2.5, seed=3)[1]
    assert [again(i) for i in range(total)] == [batch_at(i) for i in range(total)]  # a resumed job's batches
    assert shuffled_epochs(items, 4, 1, seed=4)[1](0) != batch_at(0)


def test_accumulated_epochs_split_each_step_into_equal_micro_batches():
    from prorag.training.loop import accumulated_epochs, shuffled_epochs

    items = list(range(22))
    one = accumulated_epochs(items, 4, 1, 2.0, seed=5)
    plain = shuffled_epochs(items, 4, 2.0, seed=5)
    assert one[0] == plain[0] and all(one[1](i) == plain[1](i) for i in range(one[0]))  # grad_accum 1: unchanged
    steps, batch_at = accumulated_epochs(items, 4, 2, 2.0, seed=5)
    micro, _ = shuffled_epochs(items, 2, 2.0, seed=5)
    assert steps == math.ceil(micro / 2) and all(len(batch_at(i)) == 2 for i in range(2 * steps))
    # each epoch's micro-batches cover every item once
    per_epoch = math.ceil(len(items) / 2)
    assert sorted(x for i in range(per_epoch) for x in batch_at(i)) == items
    with pytest.raises(ValueError, match="divide"):
        accumulated_epochs(items, 5, 2, 1.0, seed=0)


def test_a_micro_batch_s_dropout_is_a_function_of_the_seed_and_its_index(tmp_path):
    """What lets a launch give micro-batch i to any process: its random draws do not depend on what the process
    drew before (here the global stream is advanced before the loop; the weights come out the same), only on the
    run's seed (another seed draws other masks)."""
    def train(work, seed: int, advance: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        torch.manual_seed(seed)  # the stage's seed
        torch.rand(advance)  # another consumer of the RNG before the loop
        cfg = LoopConfig(steps=4, optimizer="sgd", lr=0.1, schedule="constant", grad_accum=2, log_every=1)
        run_loop(local_context(work, cfg), model, _batches(8), mse, cfg)
        return model

    a = train(tmp_path / "a", 3, 0)
    assert _same_weights(a, train(tmp_path / "b", 3, 7))
    assert not _same_weights(a, train(tmp_path / "c", 4, 0))


def test_a_local_run_in_a_relative_directory_registers_its_artifacts(tmp_path, monkeypatch):
    # `python -m services.trainer.launch sft cfg.json work` from a shell: a relative work dir had joined the run dir
    # twice when the stage published, after the whole training
    monkeypatch.chdir(tmp_path)
    ctx = local_context("work", CFG)
    with ctx.artifact_dir("model") as tmp:
        (tmp / "weights.bin").write_bytes(b"w")
    with ctx.artifact_file("metrics", "metrics.json") as tmp:
        tmp.write_text("{}")
    assert (tmp_path / "work" / "run" / "model" / "weights.bin").read_bytes() == b"w"
    assert (tmp_path / "work" / "run" / "metrics.json").read_text() == "{}"


def test_call_in_engine_runs_through_an_attached_engine_and_plainly_without_one():
    model = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    assert torch.equal(call_in_engine(model, lambda m: m(x)), model(x))  # no engine: a plain call
    engine = _LossModule(model, loss_fn=None)  # what accelerate's FSDP wraps, here unwrapped
    forwards = []
    engine.register_forward_hook(lambda *_: forwards.append(1))
    attach_engine(model, engine)
    assert torch.equal(call_in_engine(model, lambda m: m(x)), model(x))
    assert forwards == [1]  # inside the engine's forward, where FSDP gathers the parameters
    assert "_prorag_engine" not in dict(model.named_modules())  # not a submodule of the model it wraps


def test_an_attached_engine_is_freed_with_its_model():
    """The engine must not outlive the model (a launched process would destroy it after its process group: a
    teardown abort); a global map keyed by the model kept both to the interpreter's exit."""
    model = torch.nn.Linear(3, 2)
    engine = _LossModule(model, loss_fn=None)
    attach_engine(model, engine)
    model_ref, engine_ref = weakref.ref(model), weakref.ref(engine)
    del model, engine
    gc.collect()
    assert model_ref() is None and engine_ref() is None
