"""The one training loop every gradient-descent stage runs (SFT, the base warm-up, the selftest; RFT and RL next).

A stage supplies its data and its loss, nothing else:

* ``batch_at(i)``: the i-th micro-batch, a pure function of i (micro-batches i = step * grad_accum ...
  (step + 1) * grad_accum - 1 make optimizer step ``step``), so a resumed run sees exactly the batches an
  uninterrupted one sees;
* ``loss_fn(model, batch) -> (loss, tokens)``: a scalar loss averaged over the micro-batch, and how many
  tokens the model processed for it (the unit of tokens/s and MFU).

The loop does the rest, following the contract at the top of services/trainer/stages.py: optimizer and
learning-rate schedule by name, gradient accumulation and clipping, a checkpoint (model, optimizer,
scheduler, step; RNG states through the context) every ``checkpoint_every`` steps with exact resume,
progress events with loss, tokens/s and model-FLOPs utilisation, and a prompt return when the job is
cancelled or the trainer stops (after a checkpoint unless cancelled).

:func:`run_loop` runs every step; a stage that has work between its steps (RL rolls out through the services)
drives a :class:`TrainingLoop` itself, step by step, with the same state, checkpoints and events.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from prorag.algorithms.schedules import SCHEDULES, get_schedule
from prorag.config import cfg_field
from prorag.errors import FailedPrecondition
from prorag.modeling import num_parameters
from prorag.training.context import JobContext
from prorag.training.devices import Placement, batch_shape, is_out_of_memory, out_of_memory, to_device
from prorag.training.distributed import is_sharded, my_micro_batches
from prorag.training.flops import model_flops_utilisation, peak_matmul_flops

OPTIMIZERS = ("adamw", "sgd")


@dataclass
class LoopConfig:
    """How a stage's model is optimised (the stage's own config maps its keys onto these)."""

    steps: int = cfg_field(1, help="optimizer steps in all", min=0)
    optimizer: str = cfg_field("adamw", help="adamw, or sgd with momentum", choices=OPTIMIZERS)
    lr: float = cfg_field(1e-3, help="peak learning rate (the schedule scales it)", min=0.0, max=10.0)
    beta1: float = cfg_field(0.9, help="AdamW beta1", min=0.0, max=0.9999)
    beta2: float = cfg_field(0.95, help="AdamW beta2", min=0.0, max=0.9999)
    momentum: float = cfg_field(0.9, help="SGD momentum", min=0.0, max=0.9999)
    weight_decay: float = cfg_field(0.0, help="weight decay (decoupled for AdamW, L2 for SGD)", min=0.0, max=1.0)
    schedule: str = cfg_field("warmup_cosine", help="learning-rate schedule (prorag.algorithms.schedules)",
                              choices=tuple(SCHEDULES))
    warmup_steps: int = cfg_field(0, help="steps of linear learning-rate warm-up", min=0)
    grad_clip: float = cfg_field(1.0, help="max gradient norm (0 = off)", min=0.0)
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step; the step's gradient is their mean",
                                min=1, max=65536)
    checkpoint_every: int = cfg_field(100, help="steps between checkpoints", min=1)
    log_every: int = cfg_field(10, help="steps between progress events", min=1)
    compile: bool = cfg_field(False, help="torch.compile each decoder block (regional compilation: the loss and "
                                          "the rest of the step stay eager)")


class NonFiniteLoss(FailedPrecondition):
    """A step's loss or gradient norm was NaN or infinite; the step was not applied."""


@dataclass
class LoopResult:
    completed: bool  # False: stopped (cancelled, or the trainer is stopping) before the last step
    step: int        # optimizer steps done
    loss: float      # the last step's loss (nan when this attempt ran no step)


def build_optimizer(params, cfg: LoopConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        params = list(params)
        # one fused kernel per step instead of a loop over tensors; CUDA float32 parameters only
        fused = bool(params) and all(p.is_cuda and p.dtype == torch.float32 for p in params)
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                                 fused=fused or None)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


class _EngineCall:
    """What :func:`call_in_engine` sends through the wrapped module's forward: a function of the model."""

    def __init__(self, fn):
        self.fn = fn


class _LossModule(torch.nn.Module):
    """A stage's model and loss as one module, for accelerate to wrap.

    Why: DDP and FSDP synchronise gradients for what runs through the wrapped module's forward, and a stage's
    loss calls the model's parts directly (the trunk, then the head on the loss positions only); made the
    forward itself, all of it runs inside the engine's wrapper."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        if isinstance(batch, _EngineCall):
            return batch.fn(self.model)
        return self.loss_fn(self.model, batch)


#: the attribute of a model that holds its FSDP-wrapped _LossModule, for call_in_engine
_ENGINE_ATTR = "_prorag_engine"


def attach_engine(model: torch.nn.Module, engine: torch.nn.Module) -> None:
    """Keep ``engine`` (the wrapper of a _LossModule around ``model``) for :func:`call_in_engine`, for as long as
    ``model`` lives.

    Why an entry in the model's ``__dict__`` and not a registry keyed by the model: the engine holds the model, so
    a global map's value would keep its own key (the model) and the engine alive to the interpreter's exit, after
    the process group, which can abort a launched process in teardown (docs/BENCHMARKS.md, forty-sixth
    session); held by the model, the two are one reference cycle that a collection frees (``finish_distributed``
    collects before destroying the group). Written into ``__dict__`` directly: ``nn.Module.__setattr__`` would
    register the engine as a submodule of the model it wraps."""
    model.__dict__[_ENGINE_ATTR] = engine


def call_in_engine(model: torch.nn.Module, fn: Callable[[torch.nn.Module], Any]) -> Any:
    """``fn(model)`` for a forward pass outside the loop's steps (a stage's evaluation, RL's old log-probs).

    Under FSDP, after :func:`run_loop` prepared ``model``, the parameters outside its wrapped blocks (embeddings,
    head) are gathered only inside the wrapper's forward, so ``fn`` runs there; every process must make the same
    calls. Otherwise (one process, DDP's replicated weights) it is a plain call."""
    engine = model.__dict__.get(_ENGINE_ATTR)
    return engine(_EngineCall(fn)) if engine is not None else fn(model)


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile every decoder block of ``model`` in place (regional compilation); returns how many.

    Why blocks and not the whole model: a stage's loss calls the trunk and the head separately and selects the
    trained positions by a mask (a data-dependent shape), which would break one whole-model graph; the blocks are
    the same graph repeated, so compiling them costs one compile and keeps the state-dict keys unchanged."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for block in blocks:
        block.compile(dynamic=None)
    return len(blocks)


@contextlib.contextmanager
def _micro_batch_rng(seed: int, i: int, device: torch.device):
    """The RNG (dropout's) of micro-batch ``i`` seeded from (the run's seed, i), the stream outside left as it was.

    Why: like its data, a micro-batch's random draws are then a function of i, so a launch that gives it to
    another process, or a resumed run, draws exactly what one uninterrupted process draws (a PRM's classifier
    dropout, LoRA dropout)."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        s = (seed * 1_000_003 + i) % (2 ** 63)
        torch.default_generator.manual_seed(s)
        if device.type == "cuda":
            torch.cuda.manual_seed(s)
        yield


@dataclass
class StepResult:
    loss: float               # the step's loss (the mean of its micro-batches', over every process)
    stats: dict[str, float]   # the loss_fn's optional stats, summed over this process's micro-batches of the step


class TrainingLoop:
    """The loop's state (optimizer, schedule, a launch's engine, the steps done) held across calls, for a stage
    that drives its steps itself: RL rolls out between its optimizer steps (services/trainer/stage_rl.py), so
    its ``batch_at`` stays a pure function of i. :func:`run_loop` is :meth:`run` to the last step.

    Constructing it builds the optimizer, prepares a launch's engine once and restores the context's last
    checkpoint (``step`` is then the steps it holds); :meth:`close` (or leaving a ``with`` block) puts the model
    in eval mode and releases the engine. Arguments are :func:`run_loop`'s."""

    def __init__(self, ctx: JobContext, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], tuple], cfg: LoopConfig,
                 grad_hook: Callable[[torch.nn.Module], None] | None = None, accelerator=None,
                 placement: Placement | None = None):
        accelerator = accelerator if accelerator is not None else getattr(ctx, "accelerator", None)
        self.ctx, self.model, self.loss_fn, self.cfg, self.grad_hook = ctx, model, loss_fn, cfg, grad_hook
        self.accelerator = accelerator
        self.seed = torch.initial_seed()  # the stage's seed, taken before a checkpoint's RNG states are restored
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.rank = accelerator.process_index if accelerator is not None else 0
        if cfg.grad_accum % self.world:
            raise FailedPrecondition(f"grad_accum ({cfg.grad_accum}) must be a multiple of the {self.world} training "
                                     "processes, so each step's micro-batches split evenly over them")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.params, cfg)
        schedule = get_schedule(cfg.schedule)
        # the scheduler is never handed to accelerate: prepared, it would advance once per process per step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt,
                                                       lambda step: schedule(step, cfg.steps, cfg.warmup_steps))
        self.step = 0  # optimizer steps done
        self.trained = None
        if accelerator is None:
            state = ctx.load_checkpoint()
            if state is not None:
                model.load_state_dict(state["model"])
                self.opt.load_state_dict(state["optimizer"])
                self.sched.load_state_dict(state["scheduler"])
                self.step = int(state["step"])
        else:
            self.trained, self.opt = accelerator.prepare(_LossModule(model, loss_fn), self.opt)
            if is_sharded(accelerator):
                attach_engine(model, self.trained)
            # restored after prepare: under FSDP each process loads into its own shard
            state = ctx.load_launch_checkpoint(accelerator)
            if state is not None:
                self.sched.load_state_dict(state["scheduler"])
                self.step = int(state["step"])
        self.placement = placement if placement is not None \
            else Placement(next(model.parameters()).device, torch.float32, "sdpa")
        if cfg.compile:
            compile_blocks(model)
        # the peak of the dtype the step computes in, measured before the first window starts
        self.peak = peak_matmul_flops(self.placement.device, self.placement.dtype)
        self.n_params = num_parameters(model)
        model.train()
        self.loss = math.nan  # the last step's loss
        self._t_last, self._tokens = time.monotonic(), 0  # the progress window: since the last event

    def __enter__(self) -> "TrainingLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.model.eval()
        if self.accelerator is not None:
            # accelerate's save_state saves every model and optimizer it prepared: a later loop in this process
            # (the next stage of a test's launch) must not save this one's
            self.accelerator.free_memory()

    def _all_ranks_sum(self, *values: float) -> list[float]:
        if self.accelerator is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.reduce(t, reduction="sum").tolist()

    def save(self) -> None:
        """The checkpoint of the steps done; every process calls it (a launch's processes each save their part)."""
        if self.trained is None:
            self.ctx.save_checkpoint({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                      "scheduler": self.sched.state_dict(), "step": self.step})
        else:
            self.ctx.save_launch_checkpoint(self.accelerator, {"scheduler": self.sched.state_dict()}, self.step)

    def save_if_due(self) -> None:
        """The checkpoint every ``checkpoint_every`` steps (none after the last: the stage publishes then)."""
        if self.step and self.step % self.cfg.checkpoint_every == 0 and self.step < self.cfg.steps:
            self.save()

    def stop_requested(self) -> bool:
        """Whether the job is cancelled or the trainer is stopping, saving the checkpoint first unless cancelled.
        The main process decides for all (a collective), so every process of a launch stops at the same step."""
        flag = float(self.ctx.should_stop()) if self.rank == 0 else 0.0
        if self._all_ranks_sum(flag)[0] <= 0:
            return False
        if not self.ctx.cancelled():
            self.save()
        return True

    def train_step(self, batch_at: Callable[[int], Any],
                   grad_hook: Callable[[torch.nn.Module], None] | None = None) -> StepResult:
        """Optimizer step ``self.step`` on micro-batches ``batch_at(i)`` (i = step * grad_accum + j, this process's
        share), a progress event when due; no checkpoint (:meth:`save_if_due`). grad_hook: this step's, instead of
        the loop's."""
        cfg, accelerator, trained, placement = self.cfg, self.accelerator, self.trained, self.placement
        step, k, world = self.step, cfg.grad_accum, self.world
        metrics = {"lr": self.sched.get_last_lr()[0]}  # the rate this step uses
        self.opt.zero_grad(set_to_none=True)
        mine = my_micro_batches(step, k, self.rank, world)
        loss_v, n_tok, stats = 0.0, 0, {}
        for j, i in enumerate(mine):
            # gradients are synchronised once per step, on this process's last micro-batch
            sync = accelerator.no_sync(trained) if trained is not None and j < len(mine) - 1 \
                else contextlib.nullcontext()
            batch = to_device(batch_at(i), placement.device)
            try:
                with sync, _micro_batch_rng(self.seed, i, placement.device):
                    with placement.autocast():
                        out = trained(batch) if trained is not None else self.loss_fn(self.model, batch)
                    loss, n = out[0], out[1]
                    # the mean of the step's k micro-batches' losses; the engine averages the processes'
                    # sums, so each scales its share by world / k
                    scaled = loss * world / k
                    if accelerator is not None:
                        accelerator.backward(scaled)
                    else:
                        scaled.backward()
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                # the step was not applied: the weights and the last checkpoint are as they were
                raise out_of_memory(exc, f"at step {step + 1}/{cfg.steps}, micro-batch {i} ({batch_shape(batch)})",
                                    "lower batch_size or raise grad_accum, turn gradient_checkpointing on, or "
                                    "lower max_len; the job's last checkpoint is intact and a resubmitted job "
                                    "resumes from it") from None
            loss_v += float(loss.detach()) / k
            n_tok += int(n)
            for key, v in (out[2] if len(out) > 2 else {}).items():
                stats[key] = stats.get(key, 0.0) + v
        loss_v, n_tok = self._all_ranks_sum(loss_v, float(n_tok))
        self._tokens += int(n_tok)
        hook = grad_hook if grad_hook is not None else self.grad_hook
        if hook is not None:
            hook(self.model)
        if cfg.grad_clip:
            norm = accelerator.clip_grad_norm_(trained.parameters(), cfg.grad_clip) if trained is not None \
                else torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            metrics["grad_norm"] = float(norm)
        bad = [name for name, v in (("loss", loss_v), ("gradient norm", metrics.get("grad_norm", 0.0)))
               if not math.isfinite(v)]
        if bad:
            # stop before the optimizer writes NaN into the weights: what was saved (and published) stays good
            raise NonFiniteLoss(
                f"step {step + 1}/{cfg.steps}: the {' and the '.join(bad)} is not finite (loss {loss_v}); the "
                "step was not applied, the checkpoints and anything published so far are unchanged; lower the "
                "learning rate, check this step's data, or clip gradients (grad_clip)")
        self.opt.step()
        self.sched.step()
        self.step = done = step + 1
        self.loss = loss_v
        if self.rank == 0 and (done % cfg.log_every == 0 or done == cfg.steps):
            now = time.monotonic()
            rate = self._tokens / max(now - self._t_last, 1e-9)
            self._t_last, self._tokens = now, 0
            metrics.update(mfu=model_flops_utilisation(rate / world, self.n_params, self.peak),
                           peak_flops=self.peak, processes=world, dtype=placement.dtype_name)
            self.ctx.emit(done, cfg.steps, loss=loss_v, tokens_per_s=rate, metrics=metrics)
        return StepResult(loss_v, stats)

    def run(self, batch_at: Callable[[int], Any], until: int | None = None) -> LoopResult:
        """Steps up to ``until`` (default: the last), each after a stop check and followed by its checkpoint when
        due; completed = reached ``until``."""
        until = self.cfg.steps if until is None else until
        while self.step < until:
            if self.stop_requested():
                return LoopResult(False, self.step, self.loss)
            self.train_step(batch_at)
            self.save_if_due()
        return LoopResult(True, self.step, self.loss)


def run_loop(ctx: JobContext, model: torch.nn.Module, batch_at: Callable[[int], Any],
             loss_fn: Callable[[torch.nn.Module, Any], tuple], cfg: LoopConfig,
             grad_hook: Callable[[torch.nn.Module], None] | None = None, accelerator=None,
             placement: Placement | None = None) -> LoopResult:
    """Train ``model`` in place for ``cfg.steps`` optimizer steps, resuming from the context's last checkpoint.

    loss_fn(model, batch) -> (loss, tokens) or (loss, tokens, stats): stats, {name: float}, are summed over a
    step's micro-batches and returned by :meth:`TrainingLoop.train_step` (run_loop drops them).

    placement: where the step computes (prorag.training.devices): each micro-batch is moved to its device and the
    loss runs under autocast to its dtype, the weights and optimizer state staying as the stage built them
    (float32 for what is trained). None = the model's device in float32.

    grad_hook(model): called once per step after the micro-batches' backward passes, before clipping
    (e.g. the selftest's gradient noise). Leaves the model in eval mode.

    accelerator: an ``accelerate.Accelerator`` of a job launched on several processes
    (prorag.training.distributed): each process computes its share of every step's micro-batches
    (``my_micro_batches``), gradients are averaged by accelerate's engine (DDP, or FSDP2 by its config), and only
    the main process writes progress events. Checkpoints are the launch's (``JobContext.save_launch_checkpoint``:
    every process saves its part through accelerate's ``save_state``, atomically), resumed by every process. The
    result equals one process's within floating-point noise; grad_accum must be a multiple of the process count.
    Every process must see the same ``batch_at(i)`` for each i it is given (a stage fetches data from the
    services on the main process and hands it over: prorag.training.distributed.from_main).
    """
    loop = TrainingLoop(ctx, model, loss_fn, cfg, grad_hook=grad_hook, accelerator=accelerator, placement=placement)
    with loop:
        return loop.run(batch_at)


def shuffled_epochs(items, batch_size: int, epochs: float, seed: int) -> tuple[int, Callable[[int], list]]:
    """(total steps, batch_at) for ``epochs`` passes over ``items`` [N] in batches of ``batch_size``, each epoch
    in its own shuffled order: batch_at(i) is a function of (seed, i) only, as :func:`run_loop` needs for exact
    resume. A fractional last epoch stops part-way."""
    per_epoch = math.ceil(len(items) / batch_size)
    total = max(1, int(round(per_epoch * epochs)))

    def batch_at(i: int) -> list:
        epoch, j = divmod(i, per_epoch)
        order = list(range(len(items)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return [items[k] for k in order[j * batch_size:(j + 1) * batch_size]]

    return total, batch_at


def accumulated_epochs(items, batch_size: int, grad_accum: int, epochs: float,
                       seed: int) -> tuple[int, Callable[[int], list]]:
    """(optimizer steps, batch_at) for :func:`shuffled_epochs` with each step's ``batch_size`` items in
    ``grad_accum`` micro-batches of ``batch_size // grad_accum``: the micro-batch is the unit drawn, so
    grad_accum=1 is shuffled_epochs itself, and a launch on several processes (which needs grad_accum to be a
    multiple of their count) splits each step without an empty share."""
    if grad_accum < 1 or batch_size % grad_accum:
        raise ValueError(f"grad_accum ({grad_accum}) must divide batch_size ({batch_size})")
    micro, batch_at = shuffled_epochs(items, batch_size // grad_accum, epochs, seed)
    return math.ceil(micro / grad_accum), batch_at


__all__ = ["accumulated_epochs", "attach_engine", "call_in_engine", "compile_blocks", "LoopConfig", "LoopResult",
           "NonFiniteLoss", "OPTIMIZERS", "StepResult", "TrainingLoop", "build_optimizer", "run_loop",
           "shuffled_epochs"]
