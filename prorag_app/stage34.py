"""Stages 3 and 4 of the pipeline, and the outcome-only baseline, all from the same SFT model.

Through the services of a ServiceStack (the trainer runs every job; the policy and PRM services serve):

- ``rft`` (stage 3): the SFT model samples trajectories through a policy service serving it; the correct ones
  whose every step the stage-2 PRM approves are fine-tuned on (trainer stage ``rft``);
- ``prorag`` (stage 4): GRPO on LoRA from the RFT model with the dual-granularity advantage, step scores from
  the PRM service (trainer stage ``rl``, beta > 0), rollouts through a policy service serving the RFT model;
- ``outcome_grpo``: the same RL code from the SFT model with beta 0 and no PRM (Search-R1-style outcome-only
  GRPO), on the same questions with the same rollout budget;
- ``prorag_no_rft`` (ablation): ProRAG's RL with the PRM from the SFT model, without RFT;
- ``prorag_oracle`` (diagnostic): the same RL from the SFT model with each step scored by the reference judge on
  the gold decomposition instead of the PRM (RLConfig.step_scorer=oracle): the ceiling of the process term; it
  needs no PRM, so it runs where stage 2 trained none;
- ``reasonrag``: ReasonRAG's path from the same MCTS trees as the PRM: the sibling pairs ordered by shortest-path
  reward estimation (value margins), DPO with LoRA on the SFT model (trainer stage ``dpo``).

Each RL job publishes an adapter version per iteration and pushes it to its policy service; the final adapter is
what gets evaluated. Without a PRM (stage 2 found no labelled pairs) only the outcome-only baseline and the oracle
can run; the others are reported as skipped with the reason. With ``pool`` settings, a trainer ``rlpool`` job first
samples the SFT model on the RL's candidate questions and every RL job draws from its learnable questions only.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prorag import paths
from prorag.data.world.config import DRAWN_SPLITS
from prorag.io import sha256_file
from prorag.registry import registry, weights_sha256
from prorag_app.stack import OnDemand, ServiceStack
from prorag_app.stage_settings import Stage34Settings
from prorag_app.trainer_jobs import run_job, settings_job_id
from services.trainer.stage_rl import ORACLE_SCORING_VERSION, PRM_SCORING_VERSION, adapter_version
from services.trainer.stage_rlpool import POOL_VERSION

console = Console()

#: the stage 3-4 methods trained by the RL stage
RL_METHODS = ("prorag", "outcome_grpo", "prorag_no_rft", "prorag_oracle")
#: RL settings a question pool takes from the RL's shared ones, so it samples the candidates the RL draws from as
#: the RL samples them
POOL_FROM_RL = ("split", "min_hops", "max_questions", "temperature", "max_step_tokens", "max_steps",
                "questions_per_request", "reward", "retriever_index")


def _job_id(prefix: str, stage: str, cfg: dict, prm_sha256: str = "", pool_sha256: str = "") -> str:
    """The job id of one stage 3-4 job (prorag_app.trainer_jobs.settings_job_id): whether it uses a PRM counts,
    which PRM (its weights: the config names only the service's address, so a retrained PRM must not reuse the jobs
    its predecessor filtered or scored), and for RL with a PRM the version of what the PRM is asked to score; for the
    oracle the version of what it scores; for a job drawing from a question pool, the pool's content; for a job
    sampling a split drawn after train (the RL split), that split's content."""
    extra = {"uses_prm": bool(cfg.get("prm"))}
    if cfg.get("step_scorer") == "oracle":  # the config says oracle; the version says which rules
        extra["oracle_scoring"] = ORACLE_SCORING_VERSION
    if cfg.get("question_pool"):  # the path names a job's artifact; its content is what the RL draws from
        extra["question_pool_sha256"] = pool_sha256
    if cfg.get("split") in DRAWN_SPLITS:  # a drawn split is redrawn when a split before it changes size: its ids
        # (rl_deep_17) then name other questions, so a job sampling it is named by the content it samples
        extra["split_sha256"] = sha256_file(paths.world_dir(cfg["world"]) / f"{cfg['split']}.jsonl")
    if stage == "rlpool":
        extra["pool_version"] = POOL_VERSION
    if extra["uses_prm"]:
        extra["prm_sha256"] = prm_sha256
    if stage != "rft" and extra["uses_prm"]:
        extra["prm_scoring"] = PRM_SCORING_VERSION
    # the pool by its content alone, so a runs directory moved elsewhere still reuses the jobs
    return settings_job_id(prefix, stage, {k: v for k, v in cfg.items() if k != "question_pool"}, extra)


#: RL settings read only by the process term (services.trainer.rl_collect.group_advantages, with beta > 0)
PROCESS_ONLY = ("prm_centering", "step_score", "process_answer_step", "process_std_floor")


def rl_job_config(method: str, common: dict, base_model: str, policy: str, prm: str, beta: float,
                  question_pool: str = "") -> dict:
    """The rl job config of one RL method: ``common`` (world, topk and the profile's shared rl settings) with the
    method's start model, policy, PRM and beta; keys a method leaves at the stage's default are left out, so the
    job ids of methods that predate them do not change.

    outcome_grpo: no PRM, beta 0, no process-term settings (PROCESS_ONLY); prorag / prorag_no_rft: the PRM at
    ``prm``, ``beta``; prorag_oracle: ``beta`` with
    the reference judge's step verdicts (step_scorer=oracle), no PRM and its verdicts never centred per step kind.
    question_pool: every method's the same."""
    if method not in RL_METHODS:
        raise ValueError(f"{method!r} is not an RL method ({', '.join(RL_METHODS)})")
    if "step_scorer" in common:  # shared settings would turn ProRAG itself into the oracle
        raise ValueError("stage34.rl.step_scorer: the step scorer is the method's (prorag_oracle), not a shared "
                         "setting")
    cfg = {**common, "base_model": base_model, "policy": policy, "adapter_name": method}
    if method == "outcome_grpo":
        cfg.update(prm="", beta=0.0)
        # settings of the process term only, which beta 0 never reads: left out, so a choice among the process arms'
        # settings (a dev run of another centring) reuses the one outcome GRPO job they are all compared with
        for key in PROCESS_ONLY:
            cfg.pop(key, None)
    elif method == "prorag_oracle":
        cfg.update(prm="", beta=beta, step_scorer="oracle")
        if cfg.get("prm_centering", "none") != "none":
            # centring is for a PRM's per-kind offsets; the oracle has none, and centred, a sound step in a group
            # whose steps of its kind are all sound scores below the other kinds' and gets a negative advantage
            cfg["prm_centering"] = "none"
    else:
        cfg.update(prm=prm, beta=beta)
    if question_pool:
        cfg["question_pool"] = question_pool
    return cfg


def pool_job_config(world: str, policy_model: str, policy: str, topk: int, rl: dict, pool: dict) -> dict:
    """The rlpool job config: the candidates and sampling settings of the RL's shared settings ``rl``
    (POOL_FROM_RL), then the profile's ``pool`` settings over them."""
    return {"world": world, "policy_model": policy_model, "policy": policy, "topk": topk,
            **{k: rl[k] for k in POOL_FROM_RL if k in rl}, **pool}


def rl_summary(iterations_path: str | Path) -> dict:
    """Where an RL job's time went, per iteration (medians), from its iterations.jsonl: rollout, PRM scoring,
    update and adapter push (sync); plus its last reward and the policy lag it saw, and ``per_iteration``: each
    iteration's share of zero-variance groups and its rollouts' mean reward and F1."""
    rows = [json.loads(line) for line in Path(iterations_path).read_text().splitlines() if line.strip()]
    if not rows:
        return {"iterations": 0}
    out = {"iterations": len(rows)}
    for key, name in (("rollout_s", "rollout_s"), ("prm_s", "prm_scoring_s"), ("reward_s", "reward_s"),
                      ("update_s", "update_s"), ("push_s", "adapter_sync_s")):
        out[f"median_{name}"] = statistics.median(float(r.get(key, 0.0)) for r in rows)
    for key in ("sampled", "kept", "trained_tokens", "dropped_stale", "service_retries"):
        out[f"total_{key}"] = sum(float(r.get(key, 0.0)) for r in rows)
    out["questions"] = sum(int(r.get("questions", 0)) for r in rows)
    out["lag_max"] = max(float(r.get("lag_max", 0.0)) for r in rows)
    out["reward_first"] = float(rows[0].get("reward_mean", 0.0))
    out["reward_last"] = float(rows[-1].get("reward_mean", 0.0))
    out["f1_first"], out["f1_last"] = float(rows[0].get("f1_mean", 0.0)), float(rows[-1].get("f1_mean", 0.0))
    # one iteration's 16 questions make first/last a noisy pair: the halves' means say whether the rollouts rise
    half = len(rows) // 2
    if half:
        for key in ("reward_mean", "f1_mean"):
            early = statistics.fmean(float(r.get(key, 0.0)) for r in rows[:half])
            late = statistics.fmean(float(r.get(key, 0.0)) for r in rows[len(rows) - half:])
            out[f"{key.removesuffix('_mean')}_halves"] = [early, late]
        # over the start model's F1 on the same questions (jobs with a pool): the draw of questions cancels
        if all("start_f1_mean" in r for r in rows):
            gains = [float(r["f1_mean"]) - float(r["start_f1_mean"]) for r in rows]
            out["f1_gain_halves"] = [statistics.fmean(gains[:half]), statistics.fmean(gains[len(rows) - half:])]

    def fraction(part: str, whole: str) -> float:
        return sum(float(r.get(part, 0)) for r in rows) / max(1.0, sum(float(r.get(whole, 0)) for r in rows))

    out["groups_flat_fraction"] = fraction("groups_flat", "groups")
    # per iteration: the share of groups whose rollouts all earned one reward (zero variance: no outcome signal)
    # and the rollouts' mean reward, what shows whether RL is learning at all
    out["per_iteration"] = [{"iteration": int(r.get("iteration", i)),
                             "groups_flat_fraction": (float(r.get("groups_flat", 0))
                                                      / max(1.0, float(r.get("groups", 0)))),
                             "reward_mean": float(r.get("reward_mean", 0.0)), "f1_mean": float(r.get("f1_mean", 0.0)),
                             **({"start_f1_mean": float(r["start_f1_mean"])} if "start_f1_mean" in r else {})}
                            for i, r in enumerate(rows)]
    if any("groups_uncredited" in r for r in rows):  # jobs from before these counts have none
        out["groups_uncredited_fraction"] = fraction("groups_uncredited", "groups")
        out["deep_groups_uncredited_fraction"] = fraction("deep_groups_uncredited", "deep_groups")
    return out


def run_stage34(stack, world: str, sft_ref: str, sft_dir: str, prm_dir: str | None, sft_settings: dict,
                settings: Stage34Settings, run_dir: Path, port_offset: int, timings: dict,
                pairs_path: str | None = None, prm_gate: dict | None = None, policy_replicas: int = 1) -> dict:
    """Train what ``settings.methods`` asks through the stack's trainer (``pairs_path``: stage 2's sibling pairs,
    reasonrag's data; ``prm_gate``: stage 2's gate verdict on the PRM, {"passed", "reasons", ...}; policy_replicas:
    processes of each policy the jobs sample from, prorag_app.stack.ServiceStack.replicas). Returns {"models": {method:
    {"model": directory, "adapter": name@version or ""}}, "jobs", "rl": {method: rl_summary}, "skipped": {method: why},
    "settings", and "pool" ({"job", "path", "size", "samples", "counts"}) when ``settings.pool`` asked for one}."""
    wanted = tuple(settings.methods)
    prm_sha = weights_sha256(prm_dir) if prm_dir else ""
    out: dict = {"models": {}, "jobs": {}, "rl": {}, "skipped": {}, "settings": asdict(settings)}
    if prm_gate is not None:
        out["prm_gate"] = prm_gate
    # a method asked for runs even where the profile leaves it out (`--set stage34.methods=...`)
    out["skipped"].update({m: why for m, why in settings.left_out.items() if m not in wanted})
    prefix = f"{world}-stage34"
    topk = int(sft_settings.get("topk", 1))
    blocked = ""
    if prm_dir is None:
        blocked = "stage 2 trained no PRM (no labelled sibling pairs), so no PRM-guided stage"
    elif settings.prm_gate == "enforce" and prm_gate is not None and not prm_gate.get("passed"):
        blocked = "the PRM did not pass the gate (" + "; ".join(prm_gate.get("reasons") or ["no reason given"]) + ")"
        prm_dir, prm_sha = None, ""
    if blocked:
        for m in ("rft", "prorag", "prorag_no_rft"):
            if m in wanted:
                out["skipped"][m] = blocked
    services = ("policy", "prm") if prm_dir else ("policy",)
    overrides = {"policy": {"model": sft_dir, "retriever": stack.grpc_target("retriever"), "restore_active": False}}
    if prm_dir:
        overrides["prm"] = {"model": prm_dir, "world": world}
    # started once a job that samples through it or asks its PRM is submitted: none when they are all finished
    sft_serving = OnDemand(ServiceStack(port_offset=port_offset, world=world, services=services, overrides=overrides,
                                        log_dir=str(run_dir / "logs" / "stage34-sft-policy"),
                                        replicas={"policy": policy_replicas}))
    t0 = time.monotonic()
    with sft_serving:
        prm_target = sft_serving.grpc_target("prm") if prm_dir else ""
        sft_policy = sft_serving.grpc_target("policy")
        rl_common = {"world": world, "topk": topk, **{k: v for k, v in settings.rl.items() if k != "question_pool"}}
        rft = None
        # RFT first: it samples from what the policy serves, which must still be the SFT model, not an RL adapter
        if prm_dir and ("rft" in wanted or "prorag" in wanted):
            t = time.monotonic()
            cfg = {"world": world, "base_model": sft_ref, "policy": sft_policy, "prm": prm_target, "topk": topk,
                   "publish_name": "rft", **settings.rft}
            if cfg.get("replay"):
                cfg["retriever"] = stack.grpc_target("retriever")
            try:
                rft = run_job(stack, "rft", cfg, _job_id(prefix, "rft", cfg, prm_sha), before_start=sft_serving.need)
            except SystemExit as e:  # RFT kept nothing: report it, go on with what does not need it
                for m in ("rft", "prorag"):
                    if m in wanted:
                        out["skipped"][m] = f"the RFT job failed: {e}"
            timings["stage34_rft_s"] = time.monotonic() - t
        # the question pool next, while the policy still serves the SFT model itself: every RL method draws from it
        pool_path = settings.rl.get("question_pool", "")
        if settings.pool and any(m in wanted for m in RL_METHODS):
            t = time.monotonic()
            cfg = pool_job_config(world, sft_ref, sft_policy, topk, settings.rl, settings.pool)
            job = run_job(stack, "rlpool", cfg, _job_id(prefix, "rlpool", cfg), before_start=sft_serving.need)
            pool_path = job["outputs"]["pool_path"]
            artifact = json.loads(Path(pool_path).read_text())
            out["pool"] = {"job": job["job_id"], "path": pool_path, "size": len(artifact["pool"]),
                           "samples": artifact["samples"], "counts": artifact["counts"]}
            timings["stage34_pool_s"] = time.monotonic() - t
            if not artifact["pool"]:
                for m in RL_METHODS:
                    if m in wanted:
                        out["skipped"].setdefault(m, f"the question pool ({job['job_id']}) has no learnable "
                                                     "question: the SFT model's samples were all right or all wrong "
                                                     "on every candidate")
        pool_sha = sha256_file(pool_path) if pool_path else ""

        def train_rl(method: str, base_model: str, policy: str, model_dir: str, need=sft_serving.need) -> None:
            """One RL method's job (or its finished one), its final adapter and its iterations' summary."""
            t = time.monotonic()
            cfg = rl_job_config(method, rl_common, base_model, policy, prm_target, settings.beta, pool_path)
            job = run_job(stack, "rl", cfg, _job_id(prefix, method, cfg, prm_sha if cfg["prm"] else "", pool_sha),
                          before_start=need)
            out["jobs"][method] = job["job_id"]
            out["models"][method] = {"model": model_dir, "adapter": job["outputs"]["adapter"]}
            out["rl"][method] = rl_summary(Path(job["run_dir"]) / "iterations.jsonl")
            timings[f"stage34_{method}_s"] = time.monotonic() - t

        def runs(method: str) -> bool:
            return method in wanted and method not in out["skipped"]

        if runs("outcome_grpo"):
            train_rl("outcome_grpo", sft_ref, sft_policy, sft_dir)
        if runs("prorag_no_rft") and prm_dir:
            train_rl("prorag_no_rft", sft_ref, sft_policy, sft_dir)
        if runs("prorag_oracle"):  # no PRM needed: it runs where stage 2 trained none
            train_rl("prorag_oracle", sft_ref, sft_policy, sft_dir)
        if rft is not None:
            out["jobs"]["rft"] = rft["job_id"]
            rft_ref = rft["outputs"]["model"]
            rft_dir = str(registry("model", world).resolve(rft_ref))
            out["rft"] = {k: rft["metrics"][f"data_{k}"] for k in ("questions", "sampled", "answered", "correct",
                                                                   "prm_scored", "prm_passed", "kept",
                                                                   "questions_with_kept")
                          if f"data_{k}" in rft["metrics"]}
            if "rft" in wanted:
                out["models"]["rft"] = {"model": rft_dir, "adapter": ""}
            if runs("prorag"):
                rft_serving = OnDemand(ServiceStack(
                    port_offset=port_offset + 10, world=world, services=("policy",),
                    overrides={"policy": {"model": rft_dir, "restore_active": False,
                                          "retriever": stack.grpc_target("retriever")}},
                    log_dir=str(run_dir / "logs" / "stage34-rft-policy"), replicas={"policy": policy_replicas}))

                def need_both() -> None:  # ProRAG samples from the RFT model and asks the PRM the other stack serves
                    sft_serving.need()
                    rft_serving.need()

                with rft_serving:
                    train_rl("prorag", rft_ref, rft_serving.grpc_target("policy"), rft_dir, need=need_both)
        if "reasonrag" in wanted:
            if not pairs_path:
                out["skipped"]["reasonrag"] = "stage 2 wrote no sibling pairs, ReasonRAG's DPO data"
            else:
                t = time.monotonic()
                cfg = {"world": world, "base_model": sft_ref, "pairs": pairs_path, "label_source": "value",
                       "adapter_name": "reasonrag", **settings.dpo}
                try:
                    job = run_job(stack, "dpo", cfg, _job_id(prefix, "reasonrag", cfg))
                    out["jobs"]["reasonrag"] = job["job_id"]
                    out["models"]["reasonrag"] = {"model": sft_dir, "adapter": job["outputs"]["adapter"]}
                    out["dpo"] = {k: job["metrics"][k] for k in ("train_pairs", "pairs_read", "final_loss",
                                                                 "reward_accuracy", "steps") if k in job["metrics"]}
                except SystemExit as e:  # e.g. no value-labelled pair: report it, go on
                    out["skipped"]["reasonrag"] = f"the DPO job failed: {e}"
                timings["stage34_reasonrag_s"] = time.monotonic() - t
    timings["stage34_train_s"] = time.monotonic() - t0
    # the RL adapters after fewer iterations, evaluated like the final ones (every iteration published one)
    for m in [m for m in RL_METHODS if m in out["jobs"]]:
        final = out["rl"][m].get("iterations", 0)
        for i in settings.eval_iterations:
            if 0 < int(i) < final:
                out["models"][f"{m}@it{int(i)}"] = {"model": out["models"][m]["model"],
                                                    "adapter": f"{m}@{adapter_version(out['jobs'][m], int(i))}"}
    return out


def per_question_f1(run_dir: Path, methods) -> dict[str, list[dict[str, float]]]:
    """method -> [one seed] of {question id: F1}, from the predictions each evaluation saved."""
    out = {}
    for m in methods:
        path = Path(run_dir) / m / "predictions.jsonl"
        if path.is_file():
            out[m] = [{r["id"]: float(r["f1"]) for r in map(json.loads, path.read_text().splitlines()) if r}]
    return out


def print_comparisons(comparisons: dict, split: str = "test") -> None:
    if not comparisons:
        return
    table = Table(title=f"Paired comparisons on the {split} split: A minus B, per question (F1 x100) [95% paired "
                        "bootstrap CI]")
    for col in ("A vs B", "group", "A", "B", "A - B", "CI", "n", "wins/losses/ties"):
        table.add_column(col, justify="left" if col in ("A vs B", "group") else "right")
    for name, c in comparisons.items():
        lo, hi = c["ci"]
        table.add_row(name, c["group"], f"{100 * c['a_mean']:.1f}", f"{100 * c['b_mean']:.1f}",
                      f"{100 * c['f1_diff']:+.1f}", f"[{100 * lo:+.1f}, {100 * hi:+.1f}]", str(c["n"]),
                      f"{c['wins']}/{c['losses']}/{c['ties']}")
    console.print(table)


def print_rl(rl: dict) -> None:
    if not rl:
        return
    table = Table(title="RL jobs: median seconds per iteration, and what the rollouts scored")
    cols = ("method", "iterations", "questions", "rollout", "PRM", "update", "adapter sync", "reward first/last",
            "F1 first/last", "F1 first/second half", "F1 - start model's, halves", "flat groups")
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right")
    for m, s in rl.items():
        if not s.get("iterations"):
            continue
        table.add_row(m, str(s["iterations"]), str(s["questions"]), f"{s['median_rollout_s']:.1f}",
                      f"{s['median_prm_scoring_s']:.2f}", f"{s['median_update_s']:.1f}",
                      f"{s['median_adapter_sync_s']:.2f}", f"{s['reward_first']:.2f}/{s['reward_last']:.2f}",
                      f"{s['f1_first']:.2f}/{s['f1_last']:.2f}",
                      "/".join(f"{v:.3f}" for v in s["f1_halves"]) if "f1_halves" in s else "-",
                      "/".join(f"{v:+.3f}" for v in s["f1_gain_halves"]) if "f1_gain_halves" in s else "-",
                      f"{100 * s['groups_flat_fraction']:.0f}%")
    console.print(table)


__all__ = ["POOL_FROM_RL", "RL_METHODS", "per_question_f1", "pool_job_config",
           "print_comparisons", "print_rl", "rl_job_config", "rl_summary", "run_stage34"]
