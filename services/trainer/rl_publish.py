"""Publish and push, the first step of an RL iteration (services.trainer.stage_rl) and its last: the LoRA adapter
as it is now is saved as version ``<job id>-<iteration>``, published into the world's adapter registry (the
policy's adapter root) and pushed to every policy replica, which loads and activates it; versions past the lag
bound are unloaded. Adapter versions name the iteration, so a trajectory says how far behind it was sampled."""

from __future__ import annotations

import re
import time
from functools import partial

import grpc

from prorag.errors import FailedPrecondition, Unavailable
from prorag.rpc.clients import PolicyClient, push_adapter, wait_for_health
from prorag.training.distributed import from_main, full_state_dict
from prorag.training.lora import publish_adapter
from services.trainer.rl_config import RLConfig
from services.trainer.rl_run import RLRun


# ---------------------------------------------------------------- adapter versions
def adapter_version(job_id: str, iteration: int) -> str:
    return f"{job_id}-{iteration}"


def policy_lag(version_key: str, name: str, job_id: str, iteration: int) -> int | None:
    """How many iterations behind ``iteration`` the adapter ``version_key`` (name@version, as a trajectory
    reports it) is; None when it is not one of this job's versions (the base model, another adapter)."""
    n, _, version = version_key.partition("@")
    # a resumed attempt that had to republish a version adds ".r<k>" (versions are immutable)
    m = re.fullmatch(re.escape(job_id) + r"-(\d+)(?:\.r\d+)?", version) if n == name else None
    return iteration - int(m.group(1)) if m else None


# ---------------------------------------------------------------- publish and push
def publish_and_push(run: RLRun, iteration: int) -> tuple[str, dict]:
    """Publish the adapter as it is now (``iteration`` updates done) and make every replica serve it; returns
    the version and the push's journal numbers. Every process of a launch calls it (the weights are gathered
    from all); the main one publishes and pushes."""
    t0 = time.monotonic()
    weights = full_state_dict(run.acc, run.model)
    return from_main(run.acc, partial(_publish_on_main, run, iteration, weights, t0))


def _publish_on_main(run: RLRun, iteration: int, weights, t0: float) -> tuple[str, dict]:
    cfg, ctx = run.cfg, run.ctx
    version = publish_adapter(run.model, cfg.world, cfg.adapter_name, adapter_version(ctx.job_id, iteration),
                              base=run.base, base_sha=run.base_sha, scratch=ctx.checkpoint_dir / "adapter-scratch",
                              config={"stage": "rl", "job_id": ctx.job_id, "iteration": iteration,
                                      **ctx.config_dict}, step=iteration, state_dict=weights)
    acks = push_with_service_wait(cfg, cfg.adapter_name, version)
    ok = [a for a in acks if a.ok]
    if not ok and all_unavailable(acks):
        raise Unavailable(f"the policy service at {cfg.policy} went away and did not come back within "
                          f"service_wait_s={cfg.service_wait_s:g}s to take adapter {cfg.adapter_name}@{version} "
                          "(" + "; ".join(f"{a.replica}: {a.error}" for a in acks) + "); the job can be "
                          "resumed from its last checkpoint once it is up")
    if not ok:
        raise FailedPrecondition(f"no policy replica at {cfg.policy} took adapter {cfg.adapter_name}@{version}: "
                                 + "; ".join(f"{a.replica}: {a.error}" for a in acks))
    unloaded = unload_old(cfg, ctx.job_id, iteration, [a.replica for a in ok])
    ctx.emit(iteration, run.total, message=f"pushed {cfg.adapter_name}@{version} to {len(ok)}/{len(acks)} "
                                           f"replica(s)" + "".join(f"; {a.replica} failed: {a.error}"
                                                                    for a in acks if not a.ok))
    return version, {"push_s": time.monotonic() - t0, "push_acks": float(len(acks)),
                     "push_acked": float(len(ok)), "unloaded_versions": float(unloaded),
                     "acks": [{"replica": a.replica, "ok": a.ok, "error": a.error,
                               "latency_s": round(a.latency_s, 4)} for a in acks]}


def all_unavailable(acks) -> bool:
    """No replica answered the push at all (each ack UNAVAILABLE: the policy died, or restarts)."""
    return bool(acks) and all(a.error.startswith("UNAVAILABLE") for a in acks)


def push_with_service_wait(cfg: RLConfig, name: str, version: str) -> list:
    """push_adapter to the policy's replicas; when none took it because none answered (every ack UNAVAILABLE: the
    policy died or restarts), wait for the policy's health (service_wait_s in all) and push again."""
    deadline = time.monotonic() + cfg.service_wait_s
    while True:
        acks = push_adapter(cfg.policy, name, version, timeout=cfg.push_timeout_s)
        left = deadline - time.monotonic()
        if not acks or any(a.ok for a in acks) or not all_unavailable(acks) or left <= 0:
            return acks
        if not wait_for_health(cfg.policy, "", timeout=left):
            return acks


def push_again(cfg: RLConfig, version_key: str) -> None:
    """Push ``version_key`` (name@version) again to a policy that came back during a rollout: a replica that
    restarted without restoring it (restore_active off) gets it again; one that refuses it fails the job here
    rather than sample with another adapter (all dropped as foreign)."""
    name, _, version = version_key.partition("@")
    acks = push_adapter(cfg.policy, name, version, timeout=cfg.push_timeout_s)
    if not any(a.ok for a in acks) and not all_unavailable(acks):
        raise FailedPrecondition(f"the policy at {cfg.policy} came back but took adapter {version_key} no "
                                 "more: " + "; ".join(f"{a.replica}: {a.error}" for a in acks))


def unload_old(cfg: RLConfig, job_id: str, iteration: int, replicas: list[str]) -> int:
    """Unload this job's versions past the lag bound from the replicas, so a long run does not keep every
    version in memory; best effort: a version still serving a request stays until the next push."""
    done = 0
    for r in replicas:
        with PolicyClient(r, timeout=cfg.push_timeout_s) as c:
            try:
                listed = c.list_adapters()
                for a in listed.adapters:
                    key = f"{a.ref.name}@{a.ref.version}"
                    lag = policy_lag(key, cfg.adapter_name, job_id, iteration)
                    if key != listed.active and lag is not None and lag > cfg.max_policy_lag:
                        c.unload_adapter(a.ref.name, a.ref.version)
                        done += 1
            except grpc.RpcError:
                continue
    return done
