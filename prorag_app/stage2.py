"""Stage 2 of the pipeline: MCTS over the SFT agent's steps, judging, the PRM, and its validation.

Runs through the services of a ServiceStack: the trainer's ``mcts`` job searches train questions with the policy
service (serving the SFT agent) and the retriever, and labels the sibling pairs through the judge service; when the
settings ask for it, its ``siblings`` job samples more judged pairs along the agent's own trajectories, without a
tree (services.trainer.stage_siblings); its ``prm`` job trains the PRM on the MCTS pairs, the sibling pairs or both;
the validation scores gold steps of the dev split (whatever split the run evaluates on) against corrupted ones,
in-distribution and held-out families (prorag.prm.evaluation), with the PRM in process, gives the gate's verdict
(prm_gate) and writes a PNG of the score distributions.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from prorag import paths
from prorag.data.loaders import load_split
from prorag.prm.evaluation import FAMILIES
from prorag.registry import registry, weights_sha256
from prorag.rpc.clients import RetrieverClient
from prorag_app import memo
from prorag_app.eval import prm_results, validate_prm_families
from prorag_app.stage_settings import Stage2Settings
from prorag_app.trainer_jobs import run_job, settings_job_id
from services.trainer.stage_mcts import PAIRS_VERSION
from services.trainer.stage_siblings import RELATION_VERSION, SIBLINGS_VERSION

console = Console()

#: where the PRM is validated and gated: the gate decides which stages run, so it never reads test
VALIDATION_SPLIT = "dev"


def counts_by_kind(metrics: dict, prefix: str = "pairs_by_kind") -> dict[str, dict[str, int]]:
    """A job's flat per-kind counts ("<prefix>.<kind>.<count>", services.trainer.stage_mcts.flat_counts) back as
    {kind: {count: n}}."""
    out: dict[str, dict[str, int]] = {}
    for key, value in metrics.items():
        if key.startswith(prefix + "."):
            kind, _, name = key[len(prefix) + 1:].rpartition(".")
            out.setdefault(kind, {})[name] = int(value)
    return dict(sorted(out.items()))


def _labelled(m: dict, source: str) -> int:
    """Pairs a job's metrics say carry the label the PRM trains on (judge, value or both: where they agree)."""
    return {"judge": int(m.get("judge_labelled", 0)), "value": int(m.get("value_labelled", 0)),
            "both": round(m.get("both_labelled", 0) * m.get("judge_value_agreement", 0.0))}[source]


def siblings_job_id(job_prefix: str, sib_cfg: dict) -> str:
    """The siblings job of ``sib_cfg``: its settings and the versions of the samplers it uses, so a finished job
    whose pairs another rule made is not reused, and a sampler's new version re-runs only the jobs that use it."""
    versions = {"siblings": SIBLINGS_VERSION, **({"relation": RELATION_VERSION} if sib_cfg.get("relation_samples")
                                                 else {})}
    return settings_job_id(job_prefix, "siblings", sib_cfg, versions)


def run_stage2(stack, policy_target: str, world: str, sft_model: str, sft_settings: dict, settings: Stage2Settings,
               run_dir: Path, job_prefix: str, timings: dict, before_search=None) -> dict:
    """MCTS -> judged pairs -> PRM -> validation, through the stack's trainer, retriever and judge and the policy
    service at ``policy_target`` (serving ``sft_model``); before_search(), when given, is called just before a search
    job (mcts, siblings) is submitted, not when a finished one is reused: it starts that policy service. Returns
    results.json's "prm"."""
    t = time.monotonic()
    services = {"world": world, "policy": policy_target, "policy_model": sft_model,
                "retriever": stack.grpc_target("retriever"), "judge": stack.grpc_target("judge"),
                "topk": int(sft_settings.get("topk", 1))}
    mcts_cfg = {**services, **settings.mcts}
    # the version: a finished job whose pairs were made by another rule is not reused
    mcts = run_job(stack, "mcts", mcts_cfg, settings_job_id(job_prefix, "mcts", mcts_cfg, {"pairs": PAIRS_VERSION}),
                   before_start=before_search)
    timings["stage2_mcts_s"] = time.monotonic() - t
    m = mcts["metrics"]
    summary = {k: m.get(k) for k in ("questions", "simulations", "pairs", "pairs_per_question", "value_labelled",
                                     "judge_labelled", "both_labelled", "judge_value_agreement",
                                     "retrieval_cache_hit_rate", "simulations_per_s", "wall_s", "policy_wait_s",
                                     "retriever_wait_s", "generated_tokens")}
    jobs = {"mcts": mcts["job_id"]}
    by_kind = {"mcts": counts_by_kind(m)}
    siblings = sib_summary = None
    if settings.siblings:
        t = time.monotonic()
        sib_cfg = {**services, **settings.siblings}
        siblings = run_job(stack, "siblings", sib_cfg, siblings_job_id(job_prefix, sib_cfg),
                           before_start=before_search)
        timings["stage2_siblings_s"] = time.monotonic() - t
        jobs["siblings"] = siblings["job_id"]
        sm = siblings["metrics"]
        sib_summary = {k: sm.get(k) for k in ("questions", "prefixes", "pairs", "pairs_per_question", "judge_labelled",
                                              "siblings_sampled", "siblings_invalid", "siblings_duplicate",
                                              "trajectory_f1_mean", "wall_s", "policy_wait_s", "judge_wait_s",
                                              "generated_tokens", "reading_sampled", "reading_pairs",
                                              "reading_judge_labelled", "bridge_sampled", "bridge_pairs",
                                              "bridge_judge_labelled", "relation_sampled", "relation_pairs",
                                              "relation_judge_labelled")}
        by_kind["siblings"] = counts_by_kind(sm)
    # the jobs whose pairs the PRM trains on: (name, finished job)
    use = [("mcts", mcts)] if settings.prm_pairs in ("all", "mcts") else []
    if siblings is not None and settings.prm_pairs in ("all", "siblings"):
        use.append(("siblings", siblings))
    source = settings.prm.get("label_source", "judge")
    labelled = sum(_labelled(job["metrics"], source) for _, job in use)
    common = {"mcts": summary, **({"siblings": sib_summary} if sib_summary else {}), "pairs_by_kind": by_kind,
              "settings": asdict(settings),
              # the sibling pairs of the trees, also ReasonRAG's DPO data (its value labels) in stage 3-4
              "pairs_path": mcts["outputs"]["pairs_path"]}
    if not labelled:
        pairs = sum(int(job["metrics"].get("pairs", 0)) for _, job in use)
        reason = (f"stage 2 found no {source}-labelled sibling pairs ({pairs} pairs from the "
                  f"{' and '.join(name for name, _ in use)} job): no PRM to train")
        console.print(f"[yellow]stage 2: {reason}[/yellow]")
        return {"skipped": reason, "jobs": jobs, **common}
    t = time.monotonic()
    prm_cfg = {"world": world, "pairs": use[0][1]["outputs"]["pairs_path"], "policy_model": sft_model, **settings.prm}
    extra = {"pairs": use[0][1]["job_id"]}
    if len(use) > 1:
        prm_cfg["extra_pairs"] = use[1][1]["outputs"]["pairs_path"]
        extra["extra_pairs"] = use[1][1]["job_id"]
    prm = run_job(stack, "prm", prm_cfg, settings_job_id(job_prefix, "prm", prm_cfg, extra))
    jobs["prm"] = prm["job_id"]
    timings["stage2_prm_s"] = time.monotonic() - t
    t = time.monotonic()
    # validated on dev whatever split the run evaluates on: the gate decides which stages run, and a decision never
    # reads test (a test run reads it once, for its methods)
    held = load_split(paths.world_dir(world), VALIDATION_SPLIT)
    held = held[:settings.eval_questions] if settings.eval_questions else held
    with RetrieverClient(stack.grpc_target("retriever"), timeout=300) as client:
        ids = sorted({s.doc_id for q in held for s in q.decomposition if s.doc_id})
        docs = {d.id: d for d in client.get_documents(ids)}
    prm_dir = str(registry("prm", world).resolve(prm["outputs"]["prm"]))
    sft_dir = str(registry("model", world).resolve(sft_model))  # a directory, or a published name@version
    # the same PRM validated on the same questions by the same code is read back (prorag_app.memo)
    key = memo.memo_key("prm-validation", {"prm": weights_sha256(prm_dir), "sft": sft_settings, "seed": settings.seed,
                                           "families": list(FAMILIES), "reference": weights_sha256(sft_dir),
                                           "corpus": memo.corpus_fingerprint(world),
                                           "questions": memo.questions_fingerprint(held)})
    png = run_dir / "prm" / "scores.png"
    validation = memo.load("prm-validation", key, into=png.parent)
    if validation is None:
        # the policy the PRM starts from, scored on the same cases by its own likelihood: the reference its figures
        # are read against (docs/BENCHMARKS.md, "What the SFT policy itself knows about these steps")
        validation = validate_prm_families(prm_dir, held, docs, sft_settings, seed=settings.seed, png=png,
                                           reference_policy=sft_dir)
        memo.store("prm-validation", key, validation, [png])
    validation["png"] = str(png)
    timings["stage2_validate_s"] = time.monotonic() - t
    return {
        "model": prm["outputs"]["prm"],
        **prm_results(validation, prm["metrics"]),
        "validation_split": VALIDATION_SPLIT,
        "jobs": jobs,
        "prm_train_pairs": prm["metrics"].get("train_pairs"),
        **common,
    }


__all__ = ["VALIDATION_SPLIT", "counts_by_kind", "run_stage2", "siblings_job_id"]
