"""Training stages: a registry of named, config-validated functions, and the contract they follow.

A stage is ``fn(ctx: JobContext) -> dict`` of final metrics (the context: prorag.training.context), registered with
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

``prorag.training.loop.run_loop`` does the checkpoint, resume and stop parts for any stage that
trains by gradient descent: such a stage supplies its batches (a function of the step) and its loss.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import pkgutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from prorag import validation as v
from prorag.config import ConfigError, cfg_field, from_dict, to_dict
from prorag.errors import FailedPrecondition, InvalidArgument, NotFound
from prorag.io import sha256_file
from prorag.registry import ArtifactRef, registry, weights_sha256
from prorag.training.context import JobContext, manifest_path
from prorag.training.distributed import full_state_dict

log = logging.getLogger("prorag.trainer.stages")


#: What StartJob checks in any stage's config, by field name (prorag.validation): "name" becomes a path part,
#: "path" must lie in the data root, "model" is a directory (a path) or a published name[@version], "endpoint"
#: is a gRPC target and "url" an http(s) URL on the trainer's allowed_endpoints. A stage adds or overrides
#: kinds with register_stage(checks=...); its inputs are checked as "input" (job:<id> or a path).
FIELD_CHECKS: dict[str, str] = {
    "world": "name", "split": "name", "publish_name": "name",
    "questions": "path", "pairs": "path", "output": "path", "base_model": "path",
    "policy_model": "model", "prm_model": "model",
    "retriever": "endpoint", "policy": "endpoint", "prm": "endpoint", "judge": "endpoint",
    "openai_base_url": "url",
}
CHECK_KINDS = ("name", "path", "model", "endpoint", "url", "input")


@dataclass
class PolicySamplingConfig:
    """What a stage that samples steps from a served policy (MCTS, the sibling sampler) shares: the services it
    talks to and how it samples from them."""

    policy: str = cfg_field("127.0.0.1:50052", help="policy service that samples steps")
    policy_model: str = cfg_field("", help="required: the model the policy serves (directory, or name@version in "
                                           "the world's model registry), for its tokenizer")
    adapter: str = cfg_field("", help="policy adapter name@version ('' = the active one)")
    retriever: str = cfg_field("127.0.0.1:50051", help="retriever service")
    retriever_index: str = cfg_field("", help="retriever index ('' = its default)")
    topk: int = cfg_field(1, help="documents per subquery, as the policy was trained (the embedded agent: 1; "
                                  "ProRAG: 3)", min=1, max=20)
    service_wait_s: float = cfg_field(300.0, help="how long one policy, retriever or judge call waits, in all, for "
                                                  "a service that went away (UNAVAILABLE) to come back before the "
                                                  "job fails (UNAVAILABLE, naming the service and its address; the "
                                                  "journal keeps the finished questions); the call is made again "
                                                  "with the same seed, so a seeded job ends as it would have (for "
                                                  "MCTS: unless mcts.max_seconds counts the wait)", min=0.0)
    max_step_tokens: int = cfg_field(128, help="most tokens of one generated step", min=8, max=4096)
    max_len: int = cfg_field(2048, help="longest prefix sent to the policy (tokens)", min=64)
    concurrency: int = cfg_field(16, help="questions worked on at once (the policy service merges their step "
                                          "requests)", min=1, max=512)
    seed: int = cfg_field(0, help="base of the per-question sampling seeds (0 = unseeded)", min=0, max=2 ** 31 - 1)
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default", choices=("", "wandb", "local"))

    def validate(self) -> None:
        if not self.policy_model:
            raise ConfigError("policy_model", "required: the policy's model directory or name@version")


@dataclass(frozen=True)
class Stage:
    name: str
    config_cls: type
    fn: Callable[["JobContext"], dict | None]
    inputs: Mapping[str, bool]  # input name (a str field of config_cls) -> required
    description: str = ""
    checks: Mapping[str, str] = dataclasses.field(default_factory=dict)  # field -> kind, beyond FIELD_CHECKS


_REGISTRY: dict[str, Stage] = {}
_REG_LOCK = threading.Lock()


def register_stage(name: str, config_cls: type, fn: Callable[["JobContext"], dict | None],
                   inputs: Sequence[str] | Mapping[str, bool] = (), description: str = "",
                   replace: bool = False, checks: Mapping[str, str] | None = None) -> Stage:
    """Register a stage. ``inputs``: names of config fields holding the manifest path of an
    earlier run (a sequence means all required; a mapping gives name -> required). ``checks``: field ->
    kind (see FIELD_CHECKS) for fields whose name alone does not say what they hold; "" turns a default off."""
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
    for field_name, kind in (checks or {}).items():
        if kind and kind not in CHECK_KINDS:
            raise ValueError(f"stage {name!r}: check of {field_name!r} must be one of {CHECK_KINDS}, got {kind!r}")
    stage = Stage(name, config_cls, fn, spec, description or (fn.__doc__ or "").strip().split("\n")[0],
                  dict(checks or {}))
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


def check_job_config(stage: Stage, config: Mapping[str, Any], *, roots: Sequence[str | Path],
                     allowed_endpoints: Sequence[str]) -> None:
    """What the job config names, checked before anything runs (prorag.validation); InvalidArgument naming
    ``config.<field>``. ``config``: the caller's mapping or the built config's to_dict; nested configs are
    walked, and a field that is not a string (or is empty) is left to the config's own validation."""
    kinds = {**FIELD_CHECKS, **{n: "input" for n in stage.inputs}, **stage.checks}

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
                continue
            kind = kinds.get(key, "")
            if not kind or not isinstance(value, str) or not value:
                continue
            field = f"{prefix}{key}"
            if kind == "name":
                v.check_name(field, value)
            elif kind == "path":
                v.check_path(field, value, roots)
            elif kind == "model":
                _check_model(field, value, roots)
            elif kind == "input":
                if value.startswith("job:"):
                    v.check_name(field, value[4:])
                else:
                    v.check_path(field, value, roots)
            elif kind == "endpoint":
                v.check_endpoint(field, value, allowed_endpoints)
            elif kind == "url":
                v.check_url(field, value, allowed_endpoints)

    walk(config, "config.")


#: the check kinds that say where a job's services are, not what it computes
WHERE_KINDS = ("endpoint", "url")


def work_differences(stage: Stage, stored: Mapping[str, Any], submitted: Mapping[str, Any]) -> list[str]:
    """The fields (dotted) in which a new submission of a job asks for other work than its stored config: every
    difference except where its services are (endpoint and url fields, which `prorag run --port-offset` moves)
    and fields the stored config predates, submitted at their default (a field added later defaults to the old
    behaviour). [] means the same job, to be run or resumed against the submission's addresses."""
    kinds = {**FIELD_CHECKS, **stage.checks}
    try:
        defaults = to_dict(stage.config_cls())
    except (TypeError, ValueError):  # a config class whose defaults do not construct: no field counts as added
        defaults = {}

    def walk(old: Mapping, new: Mapping, default: Mapping, prefix: str) -> list[str]:
        out = []
        for key in sorted(set(old) | set(new)):
            if kinds.get(key) in WHERE_KINDS:
                continue
            if key not in old and key in new and key in default and new[key] == default[key]:
                continue
            a, b = old.get(key), new.get(key)
            if isinstance(a, Mapping) and isinstance(b, Mapping):
                d = default.get(key)
                out += walk(a, b, d if isinstance(d, Mapping) else {}, f"{prefix}{key}.")
            elif key not in old or key not in new or a != b:
                out.append(f"{prefix}{key}")
        return out

    return walk(stored, submitted, defaults, "")


def _check_model(field: str, value: str, roots: Sequence[str | Path]) -> None:
    # as resolve_model reads it: a directory when it looks like a path or is one, else name[@version]
    if "/" in value or value.startswith(".") or Path(value).is_dir():
        v.check_path(field, value, roots)
        return
    name, _, version = value.partition("@")
    v.check_name(field, name)
    if version:
        v.check_name(field, version)


# ---------------------------------------------------------------- inputs and manifests
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
            manifest = manifest_path(value)
        if not manifest.is_file():
            raise FailedPrecondition(f"input {name!r}: {value} is not a complete run (no {manifest})")
        try:
            json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"input {name!r}: {manifest} is unreadable ({exc})") from None
        out[name] = {"path": str(manifest), "sha256": sha256_file(manifest)}
    return out


# ---------------------------------------------------------------- built-in "selftest" stage
@dataclass
class SelftestConfig:
    """A tiny linear regression trained with the full job machinery (checkpoints, events, artifacts)."""

    steps: int = cfg_field(300, help="optimizer steps", min=1, max=1_000_000)
    batch_size: int = cfg_field(16, help="examples per step", min=1, max=65536)
    grad_accum: int = cfg_field(1, help="micro-batches per step, batch_size split evenly among them", min=1,
                                max=65536)
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
    fail_while_missing: str = cfg_field("", help="with fail_at_step: fail only while this file does not exist (tests "
                                                 "a retry once the cause is fixed)")
    init_from: str = cfg_field("", help="optional input: an earlier selftest run whose weights start this one")
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default",
                              choices=("", "wandb", "local"))

    def validate(self) -> None:
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")


def _selftest(ctx: JobContext) -> dict:
    """Linear regression on seeded synthetic data; resumable to the exact same weights."""
    import torch

    from prorag.training.loop import LoopConfig, run_loop

    cfg: SelftestConfig = ctx.config
    data_gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.n_samples, cfg.dim, generator=data_gen)
    w_true = torch.randn(cfg.dim, 1, generator=data_gen)
    y = x @ w_true + 0.1 * torch.randn(cfg.n_samples, 1, generator=data_gen)

    ctx.seed_everything(cfg.seed)
    model = torch.nn.Linear(cfg.dim, 1)
    if "init_from" in ctx.inputs:
        from prorag.training.checkpoint import load_weights_file

        model.load_state_dict(load_weights_file(ctx.input_artifact("init_from", "weights")))

    micro = cfg.batch_size // cfg.grad_accum
    per_epoch = math.ceil(cfg.n_samples / micro)
    perms: dict[int, torch.Tensor] = {}

    def batch_at(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == cfg.fail_at_step * cfg.grad_accum and not (cfg.fail_while_missing
                                                           and Path(cfg.fail_while_missing).exists()):
            raise RuntimeError(f"selftest: failing at step {cfg.fail_at_step} as configured (fail_at_step)")
        # The batch depends on (seed, epoch) only, so a resumed run sees the same batches.
        epoch, j = divmod(i, per_epoch)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
                cfg.seed * 1_000_003 + epoch))
        idx = perms[epoch][j * micro:(j + 1) * micro]
        return x[idx], y[idx]

    def mse(m: torch.nn.Module, batch) -> tuple[torch.Tensor, int]:
        xb, yb = batch
        return torch.nn.functional.mse_loss(m(xb), yb), len(xb)  # throughput counted in examples

    def noise_and_delay(m: torch.nn.Module) -> None:
        if cfg.grad_noise:  # from the global torch RNG, so resuming must restore RNG state
            for p in m.parameters():
                p.grad.add_(torch.randn_like(p.grad) * cfg.grad_noise)
        if cfg.step_sleep_s:
            time.sleep(cfg.step_sleep_s)

    loop = LoopConfig(steps=cfg.steps, optimizer="sgd", lr=cfg.lr, momentum=cfg.momentum, schedule="warmup_cosine",
                      grad_clip=0.0, grad_accum=cfg.grad_accum, checkpoint_every=cfg.checkpoint_every,
                      log_every=cfg.log_every)
    result = run_loop(ctx, model, batch_at, mse, loop, grad_hook=noise_and_delay)
    if not result.completed:
        return {}
    with torch.no_grad():
        full = float(torch.nn.functional.mse_loss(model(x), y))
        werr = float(torch.linalg.vector_norm(model.weight.detach().T - w_true))
    with ctx.artifact_file("weights", "weights.pt") as tmp:
        torch.save(model.state_dict(), tmp)
    return {"final_loss": full, "train_loss": result.loss, "weight_error": werr}


register_stage("selftest", SelftestConfig, _selftest, inputs={"init_from": False},
               description="tiny seeded linear regression exercising checkpoints, resume, events and artifacts")


def load_stage_modules(names: Sequence[str] = ()) -> list[str]:
    """Import modules that register stages: ``names`` plus any ``services.trainer.stage_*`` module."""
    here = Path(__file__).resolve().parent
    found = [f"services.trainer.{m.name}" for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("stage_")]
    env = [n for n in os.environ.get("PRORAG_TRAINER_STAGES", "").split(",") if n.strip()]
    loaded = []
    for name in [*names, *env, *found]:
        importlib.import_module(name.strip())  # a broken stage module should stop the trainer loudly
        loaded.append(name.strip())
    return loaded


def resolve_model(world: str, spec: str, field_name: str):
    """A stage's model setting -> its directory: a directory, or name[@version] in ``world``'s model registry.
    A missing one is the job config's mistake, named by its field."""
    if not spec:
        raise InvalidArgument(f"{field_name} is required: a model directory or a published name@version")
    try:
        return registry("model", world).resolve(spec)
    except NotFound as e:
        raise InvalidArgument(f"{field_name} {spec!r}: {e}") from None


def publish_trained(ctx: JobContext, model, tokenizer, *, kind: str, world: str, name: str, base: Path, stage: str,
                    metrics: dict, step: int):
    """Publish a trained model whole as name@<job id> in ``world``'s ``kind`` registry (the job's artifact of that
    name), recording the base it trained from. Every process of a launch must call it: the weights are gathered
    from all of them. Returns (registry, ref) on the main process; None on the others, which publish nothing."""
    # torch and transformers: loaded only by the stages that train
    from prorag.modeling import save_pretrained

    weights = full_state_dict(ctx.accelerator, model)
    if not ctx.is_main:
        return None
    with ctx.artifact_dir(kind) as tmp:
        # save_pretrained writes a directory of its own; its files become the artifact's
        save_pretrained(model, tokenizer, tmp / "m", state_dict=weights)
        for f in (tmp / "m").iterdir():
            f.rename(tmp / f.name)
        (tmp / "m").rmdir()
    published = registry(kind, world)
    ref = ArtifactRef.of(name, ctx.job_id)
    published.publish(ctx.run_dir / kind, ref, base_model=str(base), base_model_sha256=weights_sha256(base),
                      config={"stage": stage, "job_id": ctx.job_id, **ctx.config_dict}, metrics=metrics, step=step)
    return published, ref
