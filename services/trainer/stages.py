"""Training stages: a registry of named, config-validated functions, and the JobContext they run with.

A stage is ``fn(ctx: JobContext) -> dict`` of final metrics, registered with
``register_stage(name, config_cls, fn, inputs=...)``. The job manager validates the
config strictly (``prorag.config.from_dict``) and checks the declared inputs before a
job is accepted, so a bad submission fails at StartJob, not an hour into a run.

Writing a resumable stage:

* derive everything random from the config's seed: ``ctx.seed_everything(seed)`` for the
  global RNGs, and the batch order from ``(seed, epoch)`` only (e.g. a permutation drawn
  from a generator seeded with both), so step ``s`` always maps to the same batch;
* call ``state = ctx.load_checkpoint()`` after building model/optimizer/scheduler; when it
  returns a dict, load their state dicts and continue from ``state["step"]`` (the RNG
  states are already restored);
* every N steps call ``ctx.save_checkpoint({"model": ..., "optimizer": ..., "scheduler": ...,
  "step": done})`` (plus any other data position the stage needs);
* poll ``ctx.should_stop()`` once per step and return promptly when it is true (save a
  checkpoint first unless ``ctx.cancelled()``): returning after a stop means "stopped",
  never "done";
* write outputs with ``with ctx.artifact_file(name, filename) as tmp: ...`` (or an
  already complete file/dir via ``ctx.write_artifact``), never in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from prorag import paths
from prorag.config import ConfigError, cfg_field, from_dict, to_dict
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.io import atomic_dir, atomic_path, sha256_file

log = logging.getLogger("prorag.trainer.stages")


class StageStopped(Exception):
    """Raised by ``JobContext.check_stop()``: the job was cancelled or the trainer is stopping."""


@dataclass(frozen=True)
class Stage:
    name: str
    config_cls: type
    fn: Callable[["JobContext"], dict | None]
    inputs: Mapping[str, bool]  # input name (a str field of config_cls) -> required
    description: str = ""


_REGISTRY: dict[str, Stage] = {}
_REG_LOCK = threading.Lock()


def register_stage(name: str, config_cls: type, fn: Callable[["JobContext"], dict | None],
                   inputs: Sequence[str] | Mapping[str, bool] = (), description: str = "",
                   replace: bool = False) -> Stage:
    """Register a stage. ``inputs``: names of config fields holding the manifest path of an
    earlier run (a sequence means all required; a mapping gives name -> required)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"stage name must be alphanumeric (with - or _), got {name!r}")
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"stage {name!r}: config_cls must be a dataclass")
    spec = dict(inputs) if isinstance(inputs, Mapping) else {n: True for n in inputs}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for input_name in spec:
        if input_name not in fields:
            # An input is passed like any other setting, so the config must carry it.
            raise TypeError(f"stage {name!r}: input {input_name!r} must be a str field of {config_cls.__name__}")
    stage = Stage(name, config_cls, fn, spec, description or (fn.__doc__ or "").strip().split("\n")[0])
    with _REG_LOCK:
        if name in _REGISTRY and not replace and _REGISTRY[name].fn is not fn:
            raise ValueError(f"stage {name!r} is already registered")
        _REGISTRY[name] = stage
    return stage


def unregister_stage(name: str) -> None:
    with _REG_LOCK:
        _REGISTRY.pop(name, None)


def known_stages() -> list[str]:
    return sorted(_REGISTRY)


def get_stage(name: str) -> Stage:
    stage = _REGISTRY.get(name)
    if stage is None:
        raise InvalidArgument(f"unknown stage {name!r}; known stages: {', '.join(known_stages()) or '(none)'}")
    return stage


def validate_config(stage: Stage, config: Mapping[str, Any] | None) -> Any:
    """The stage's config object; an unknown key or bad value -> InvalidArgument naming ``config.<field>``."""
    if config is not None and not isinstance(config, Mapping):
        raise InvalidArgument(f"config must be a JSON object, got {type(config).__name__}")
    try:
        return from_dict(stage.config_cls, dict(config or {}))
    except ConfigError as exc:
        raise InvalidArgument(f"config.{exc}") from None
    except (TypeError, ValueError) as exc:  # a config's own validate() may raise these
        raise InvalidArgument(f"config: {exc}") from None


# ---------------------------------------------------------------- inputs and manifests
def _manifest_path(value: str) -> Path:
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = paths.home() / p
    return p / "manifest.json" if p.is_dir() or p.name != "manifest.json" else p


def resolve_inputs(stage: Stage, cfg: Any,
                   job_lookup: Callable[[str], Path | None] | None = None) -> dict[str, dict]:
    """{input: {"path": manifest path, "sha256": its digest}}; a missing or incomplete run -> FailedPrecondition.

    A value is a run's manifest.json, its run dir, or ``job:<job_id>`` of this trainer.
    """
    out = {}
    for name, required in stage.inputs.items():
        value = str(getattr(cfg, name) or "")
        if not value:
            if required:
                raise InvalidArgument(f"config.{name}: input {name!r} is required (the manifest path of an "
                                      f"earlier run, its run dir, or job:<job_id>)")
            continue
        if value.startswith("job:"):
            run_dir = job_lookup(value[4:]) if job_lookup else None
            if run_dir is None:
                raise FailedPrecondition(f"input {name!r}: job {value[4:]!r} is unknown to this trainer")
            manifest = Path(run_dir) / "manifest.json"
        else:
            manifest = _manifest_path(value)
        if not manifest.is_file():
            raise FailedPrecondition(f"input {name!r}: {value} is not a complete run (no {manifest})")
        try:
            json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"input {name!r}: {manifest} is unreadable ({exc})") from None
        out[name] = {"path": str(manifest), "sha256": sha256_file(manifest)}
    return out


def load_manifest(path: str | Path) -> dict:
    """A run's manifest with each artifact's ``abs_path`` (manifests store paths relative to the run dir)."""
    path = _manifest_path(str(path))
    data = json.loads(path.read_text())
    for art in data.get("artifacts", []):
        art["abs_path"] = str((path.parent / art["path"]).resolve())
    return data


def artifact_path(manifest: str | Path, name: str) -> Path:
    for art in load_manifest(manifest).get("artifacts", []):
        if art["name"] == name:
            return Path(art["abs_path"])
    raise FailedPrecondition(f"run {manifest} has no artifact {name!r}")


def sha256_tree(path: str | Path) -> str:
    """sha256 of a file, or of a directory as sorted (relative path, file digest) pairs."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(p).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the context a stage runs with
class JobContext:
    """What a running stage sees: its config, directories, progress events, checkpoints, artifacts."""

    def __init__(self, *, job_id: str, stage: str, config: Any, run_dir: Path, checkpoint_dir: Path,
                 inputs: dict[str, dict], emit_fn: Callable[[dict], None], artifact_fn: Callable[[dict], None],
                 cancel_event: threading.Event, stop_event: threading.Event, tracker: Any = None,
                 keep_checkpoints: int = 2, total_steps: int = 0):
        self.job_id = job_id
        self.stage = stage
        self.config = config
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.inputs = {k: Path(v["path"]) for k, v in inputs.items()}
        self.keep_checkpoints = keep_checkpoints
        self.log = logging.getLogger(f"prorag.trainer.job.{stage}")
        self.resumed_from_step: int | None = None
        self._emit_fn = emit_fn
        self._artifact_fn = artifact_fn
        self._cancel = cancel_event
        self._stop = stop_event
        self._tracker = tracker
        self._origin: tuple[float, int] | None = None  # (time, step) the rate is measured from
        self._total = total_steps  # known from an earlier attempt; updated by every emit()

    @property
    def config_dict(self) -> dict:
        return to_dict(self.config)

    # -- control
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def should_stop(self) -> bool:
        """True once the job is cancelled or the trainer is shutting down: return at the next step."""
        return self._cancel.is_set() or self._stop.is_set()

    def check_stop(self) -> None:
        if self.should_stop():
            raise StageStopped("cancelled" if self.cancelled() else "trainer is stopping")

    @staticmethod
    def seed_everything(seed: int) -> None:
        import torch

        random.seed(seed)
        np.random.seed(seed % (2 ** 32))
        torch.manual_seed(seed)

    # -- progress
    def emit(self, step: int, total_steps: int, loss: float | None = None, tokens_per_s: float | None = None,
             message: str = "", metrics: dict | None = None, artifacts: list[dict] | None = None) -> None:
        """A progress event (eta from the step rate since this attempt began) and a metrics row."""
        now = time.monotonic()
        self._total = total_steps
        if self._origin is None or step < self._origin[1]:
            self._origin = (now, step)
        t0, s0 = self._origin
        eta = None
        if total_steps and step > s0 and now > t0:
            eta = max(0.0, (total_steps - step) * (now - t0) / (step - s0))
        row = dict(metrics or {})
        if loss is not None:
            row["loss"] = float(loss)
        if tokens_per_s is not None:
            row["tokens_per_s"] = float(tokens_per_s)
        if self._tracker is not None and row:
            self._tracker.log(step, row)
        self._emit_fn({"step": int(step), "total_steps": int(total_steps), "loss": loss, "tokens_per_s": tokens_per_s,
                       "eta_s": eta, "message": message, "metrics": metrics or {}, "artifacts": artifacts or []})

    def log_metrics(self, step: int, metrics: dict) -> None:
        """A metrics row without a progress event (e.g. per-step values between events)."""
        if self._tracker is not None:
            self._tracker.log(step, metrics)

    # -- checkpoints
    def save_checkpoint(self, state: dict, step: int | None = None) -> Path:
        from prorag.training import checkpoint

        if step is None:
            if "step" not in state:
                raise ValueError("save_checkpoint needs the step: put it in state['step'] or pass step=")
            step = int(state["step"])
        path = checkpoint.save(self.checkpoint_dir, state, step, keep=self.keep_checkpoints)
        self._emit_fn({"step": step, "total_steps": self._total, "message": f"checkpoint saved at step {step}",
                       "checkpoint_step": step})
        return path

    def load_checkpoint(self, restore_rng: bool = True) -> dict | None:
        """The latest checkpoint's state (RNG states restored), or None on a fresh start."""
        from prorag.training import checkpoint

        checkpoint.cleanup_temp(self.checkpoint_dir)
        found = checkpoint.load_latest(self.checkpoint_dir)
        if found is None:
            if self._tracker is not None:
                self._tracker.rewind(0)  # an attempt killed before its first checkpoint starts over
            return None
        state, path = found
        if restore_rng and "rng" in state:
            checkpoint.restore_rng(state["rng"])
        step = int(state["step"])
        self.resumed_from_step = step
        if self._tracker is not None:
            self._tracker.rewind(step)
        self._origin = (time.monotonic(), step)
        self._emit_fn({"step": step, "total_steps": self._total, "message": f"resumed from step {step}",
                       "resumed_from_step": step})
        return state

    # -- artifacts
    def write_artifact(self, name: str, path: str | Path) -> dict:
        """Register a complete file or directory as an artifact (copied in atomically if outside the run dir)."""
        p = Path(path)
        if not p.is_absolute():
            p = self.run_dir / p
        if not p.exists():
            raise FileNotFoundError(f"artifact {name!r}: {p} does not exist")
        run = self.run_dir.resolve()
        if run not in p.resolve().parents:
            dest = self.run_dir / p.name
            if p.is_dir():
                with atomic_dir(dest) as tmp:
                    shutil.copytree(p, tmp, dirs_exist_ok=True)
            else:
                with atomic_path(dest) as tmp:
                    shutil.copyfile(p, tmp)
            p = dest
        art = {"name": name, "path": p.resolve().relative_to(run).as_posix(), "sha256": sha256_tree(p)}
        self._artifact_fn(art)
        return art

    @contextlib.contextmanager
    def artifact_file(self, name: str, filename: str | None = None) -> Iterator[Path]:
        """Yield a temp path; when the block succeeds it becomes ``run_dir/filename`` and is registered."""
        dest = self.run_dir / (filename or name)
        with atomic_path(dest) as tmp:
            yield tmp
        self.write_artifact(name, dest)

    @contextlib.contextmanager
    def artifact_dir(self, name: str, dirname: str | None = None) -> Iterator[Path]:
        """Like artifact_file for a directory (e.g. ``save_pretrained``)."""
        dest = self.run_dir / (dirname or name)
        with atomic_dir(dest) as tmp:
            yield tmp
        self.write_artifact(name, dest)

    def input_manifest(self, name: str) -> dict:
        return load_manifest(self.inputs[name])

    def input_artifact(self, input_name: str, artifact_name: str) -> Path:
        return artifact_path(self.inputs[input_name], artifact_name)


# ---------------------------------------------------------------- built-in "selftest" stage
@dataclass
class SelftestConfig:
    """A tiny linear regression trained with the full job machinery (checkpoints, events, artifacts)."""

    steps: int = cfg_field(300, help="optimizer steps", min=1, max=1_000_000)
    batch_size: int = cfg_field(16, help="examples per step", min=1, max=65536)
    n_samples: int = cfg_field(256, help="size of the synthetic data set", min=1, max=10_000_000)
    dim: int = cfg_field(8, help="input features", min=1, max=4096)
    lr: float = cfg_field(0.05, help="peak learning rate (cosine decay to 0)", min=0.0, max=1.0)
    momentum: float = cfg_field(0.9, help="SGD momentum (optimizer state to checkpoint)", min=0.0, max=0.999)
    grad_noise: float = cfg_field(0.01, help="std of Gaussian noise added to gradients from the global torch "
                                             "RNG (so resuming must restore RNG state)", min=0.0, max=10.0)
    seed: int = cfg_field(0, help="seed for data, init, batch order and noise", min=0, max=2 ** 31 - 1)
    checkpoint_every: int = cfg_field(50, help="steps between checkpoints", min=1)
    log_every: int = cfg_field(10, help="steps between progress events", min=1)
    step_sleep_s: float = cfg_field(0.0, help="artificial delay per step, so tests can interrupt a run",
                                    min=0.0, max=10.0)
    fail_at_step: int = cfg_field(-1, help="raise an error at this step (tests the FAILED path); -1 = never",
                                  min=-1)
    init_from: str = cfg_field("", help="optional input: an earlier selftest run whose weights start this one")
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default",
                              choices=("", "wandb", "local"))


def _selftest(ctx: JobContext) -> dict:
    """Linear regression on seeded synthetic data; resumable to the exact same weights."""
    import torch

    cfg: SelftestConfig = ctx.config
    data_gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.n_samples, cfg.dim, generator=data_gen)
    w_true = torch.randn(cfg.dim, 1, generator=data_gen)
    y = x @ w_true + 0.1 * torch.randn(cfg.n_samples, 1, generator=data_gen)

    ctx.seed_everything(cfg.seed)
    model = torch.nn.Linear(cfg.dim, 1)
    if "init_from" in ctx.inputs:
        model.load_state_dict(torch.load(ctx.input_artifact("init_from", "weights"), weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps)

    start = 0
    state = ctx.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])

    per_epoch = math.ceil(cfg.n_samples / cfg.batch_size)
    perms: dict[int, torch.Tensor] = {}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The batch for a step depends on (seed, epoch) only, so a resumed run sees the same batches.
        epoch, i = divmod(step, per_epoch)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
                cfg.seed * 1_000_003 + epoch))
        idx = perms[epoch][i * cfg.batch_size:(i + 1) * cfg.batch_size]
        return x[idx], y[idx]

    def snapshot(done: int) -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": done, "epoch": done // per_epoch, "batch_in_epoch": done % per_epoch}

    t_last, s_last, loss = time.monotonic(), start, float("nan")
    for step in range(start, cfg.steps):
        if ctx.should_stop():
            if not ctx.cancelled():
                ctx.save_checkpoint(snapshot(step))
            return {}
        if step == cfg.fail_at_step:
            raise RuntimeError(f"selftest: failing at step {step} as configured (fail_at_step)")
        xb, yb = batch(step)
        out = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        out.backward()
        if cfg.grad_noise:
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p.grad) * cfg.grad_noise)
        opt.step()
        sched.step()
        loss = float(out.detach())
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            now = time.monotonic()
            rate = (done - s_last) * cfg.batch_size / max(now - t_last, 1e-9)
            t_last, s_last = now, done
            ctx.emit(done, cfg.steps, loss=loss, tokens_per_s=rate, metrics={"lr": sched.get_last_lr()[0]})
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            ctx.save_checkpoint(snapshot(done))
        if cfg.step_sleep_s:
            time.sleep(cfg.step_sleep_s)

    with torch.no_grad():
        full = float(torch.nn.functional.mse_loss(model(x), y))
        werr = float(torch.linalg.vector_norm(model.weight.detach().T - w_true))
    with ctx.artifact_file("weights", "weights.pt") as tmp:
        torch.save(model.state_dict(), tmp)
    return {"final_loss": full, "train_loss": loss, "weight_error": werr}


register_stage("selftest", SelftestConfig, _selftest, inputs={"init_from": False},
               description="tiny seeded linear regression exercising checkpoints, resume, events and artifacts")


def load_stage_modules(names: Sequence[str] = ()) -> list[str]:
    """Import modules that register stages: ``names`` plus any ``services.trainer.stage_*`` module."""
    import importlib
    import pkgutil

    here = Path(__file__).resolve().parent
    found = [f"services.trainer.{m.name}" for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("stage_")]
    env = [n for n in os.environ.get("PRORAG_TRAINER_STAGES", "").split(",") if n.strip()]
    loaded = []
    for name in [*names, *env, *found]:
        importlib.import_module(name.strip())  # a broken stage module should stop the trainer loudly
        loaded.append(name.strip())
    return loaded
