"""`prorag run`: the main job on the embedded default.

1. Builds what is missing: the world, its indexes, the embedded base policy.
2. Starts the five services (as `prorag up` does).
3. Measures retrieval quality on the test split (recall@k of gold supporting documents per hop).
4. Trains, through the trainer service, the SFT policy (ProRAG step format) and the two baselines
   trained on the same questions the same way (no retrieval; standard RAG), each published as a
   versioned model. Jobs are idempotent: a second run reuses finished jobs.
5. Evaluates each model through a policy service serving it (rollouts call the retriever service),
   prints EM/F1 per hop count and type with 95% bootstrap CIs, and writes runs/latest/results.json.
6. Stage 2 on the trained agent (prorag_app.stage2): MCTS, judged sibling pairs, the PRM and its validation.
7. Stages 3-4 and the outcome-only baseline from the same agent (prorag_app.stage34): RFT, ProRAG's RL on the RFT
   model, outcome-only GRPO on the SFT model; each evaluated like the others, and compared per question
   (paired bootstrap CIs on 3+ hop questions, results.json's "comparisons").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prorag import paths
from prorag.config import from_dict
from prorag.data.loaders import load_split
from prorag.data.world import (DEEP_SPLITS, HELDOUT_DEEP_SPLIT, RL_SPLIT, ensure_deep_split, ensure_heldout_split,
                               ensure_rl_split)
from prorag.errors import InvalidArgument
from prorag.evaluation import (MULTI_HOP_MIN, compare_methods, grouped_mean_ci, margin_beyond_cis, question_entity,
                               recall_at_k, retrieval_queries)
from prorag.methods import COMPARISONS, base_method, get_method
from prorag.modeling import load_policy
from prorag.probes import name_copy_accuracy
from prorag.progress import progress_bars
from prorag.registry import published_config, registry, weights_sha256
from prorag.rpc.clients import PolicyClient, RetrieverClient, push_adapter
from prorag.rpc.clients_trainer import TrainerClient, state_name
from prorag.runs import code_version, new_run_dir, point_latest, timed, write_results
from prorag_app import memo
from prorag_app.embedded import ensure_indexes, ensure_policy_model
from prorag_app.eval import evaluate, format_table, print_prm_families, reader_settings
from prorag_app.profiles import (ABLATION, HELDOUT_QUESTIONS, PROFILES, RL_QUESTIONS, AblationPlan, Profile,
                                 with_overrides, with_stage34)
from prorag_app.report import answer_errors_of, build_report
from prorag_app.run_tables import (console, print_answer_errors, print_diagnostics, print_figure, print_retrieval_table,
                                   print_stage34)
from prorag_app.stack import OnDemand, ServiceStack, default_policy_replicas
from prorag_app.stage2 import run_stage2
from prorag_app.stage34 import per_question_f1, print_comparisons, run_stage34
from prorag_app.stage_settings import Stage2Settings, Stage34Settings
from prorag_app.trainer_jobs import follow_job, trainer_gone

KS = (1, 3, 5, 10)
INDEXES = ("dense", "bm25", "hybrid")


# ---------------------------------------------------------------- retrieval quality
def evaluate_retrieval(client: RetrieverClient, questions, indexes=INDEXES, ks=KS, batch: int = 256) -> dict:
    """Recall@k through the retriever service for gold sub-questions and whole questions."""
    sub, whole = retrieval_queries(questions)
    out = {}
    for index in indexes:
        res = {}
        for name, items in (("subquery", sub), ("question", whole)):
            ranked = []
            for i in range(0, len(items), batch):
                chunk = items[i:i + batch]
                docs = client.search([it["query"] for it in chunk], topk=max(ks), index=index, timeout=300)
                ranked += [[d.id for d in ds] for ds in docs]
            gold = [it["gold"] for it in items]
            groups = [it["group"] for it in items]
            res[name] = {f"recall@{k}": grouped_mean_ci(recall_at_k(ranked, gold, k), groups) for k in ks}
        out[index] = res
    return out


# ---------------------------------------------------------------- training through the trainer
#: bumped when a finished job's outputs change shape, so older jobs are not reused (2: Job.outputs["model"])
JOB_FORMAT = 2


def job_id_for(world: str, method: str, config: dict) -> str:
    """Same config and base weights -> same job id, so a second `make run` reuses the finished job,
    while a rebuilt base (same path, new weights) trains anew. The retriever address is excluded:
    it moves with --port-offset but does not change the data. JOB_FORMAT changes the ids when what a job
    leaves behind changes (jobs finished before the registry name no model in their outputs)."""
    key = {k: v for k, v in config.items() if k not in ("retriever", "threads")}  # where and how fast, not what
    key["base_sha256"] = weights_sha256(config["base_model"])
    key["job_format"] = JOB_FORMAT
    return f"{world}-{method}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]}"


def method_config(stack: ServiceStack, method: str, profile: Profile, base_model: str, world: str,
                  threads: int = 0) -> dict:
    """The SFT job config of ``method``; ``threads`` (torch threads per job, 0 = the trainer's) is left out of
    the job id, as it changes the speed and not the model."""
    config = {"world": world, "base_model": base_model, "retriever": stack.grpc_target("retriever"),
              "publish_name": method, **profile.sft_for(method)}
    if threads and "threads" not in config:
        config["threads"] = threads
    return config


def train_methods(stack: ServiceStack, methods, profile: Profile, base_model: str, world: str,
                  threads: int = 0) -> dict[str, dict]:
    """Run (or reuse) every method's training job on ``world`` through the trainer service: all are submitted
    first, in the given order, so a trainer with ``parallel_jobs`` > 1 runs them side by side; then each is
    awaited.

    Returns method -> {"job_id", "metrics", "run_dir", "model", "train_s"}: "model" is the registry reference the
    job published; "train_s" the job's own running time (its queue wait left out)."""
    ids, fresh = {}, []
    with TrainerClient(stack.grpc_target("trainer"), timeout=60, wait_for_ready=True) as client:
        existing = {j.job_id: j for j in client.list("sft")}
        for method in methods:
            config = method_config(stack, method, profile, base_model, world, threads)
            ids[method] = job_id = job_id_for(world, method, config)
            if job_id in existing and state_name(existing[job_id].state) == "SUCCEEDED":
                console.print(f"[green]{method}[/green]: reusing finished job {job_id}")
            else:
                client.start("sft", config, job_id=job_id)
                fresh.append(method)
        with progress_bars() as progress:
            errors: list[BaseException] = []
            seconds = {m: 0.0 for m in methods}

            def watch(method: str) -> None:
                try:
                    with TrainerClient(stack.grpc_target("trainer"), timeout=60, wait_for_ready=True) as own:
                        seconds[method] = follow_job(own, ids[method], f"train {method}", progress,
                                                     gone=trainer_gone(stack))
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    errors.append(exc)

            watchers = [threading.Thread(target=watch, args=(m,), daemon=True) for m in fresh]
            for t in watchers:
                t.start()
            for t in watchers:
                t.join()
            if errors:
                raise errors[0]
        out = {}
        for method in methods:
            job = client.get(ids[method])
            state = state_name(job.state)
            if state != "SUCCEEDED":
                raise SystemExit(f"training {method} ended {state}: {job.error}")
            if "model" not in job.outputs:
                raise SystemExit(f"training {method}: job {ids[method]} succeeded but names no published model")
            out[method] = {"job_id": ids[method], "metrics": dict(job.metrics), "run_dir": job.run_dir,
                           "model": job.outputs["model"], "train_s": round(seconds[method], 1)}
        return out


def training_parallelism(n_jobs: int, cores: int | None = None) -> tuple[int, int]:
    """(jobs side by side, torch threads per job) for training ``n_jobs`` small CPU policies on ``cores``.

    Each job keeps at least two threads: on 2 cores one embedded policy's step runs 1.73x faster on 2 threads
    than on 1, and two jobs of 1 thread side by side gain only 17% over one of 2 (docs/BENCHMARKS.md), so on 2
    cores splitting them would slow the agent's job, the longest, by ~1.7x. Beyond a few threads a small
    model's step hardly speeds up, so bigger machines run the jobs side by side."""
    cores = cores or os.cpu_count() or 1
    parallel = max(1, min(n_jobs, cores // 2))
    return parallel, max(1, cores // parallel)


#: memory one evaluation's policy process may reach: the four-layer agent's held 1-2 GB serving an evaluation and
#: `prorag diagnose rl`'s 2.0 GB (docs/BENCHMARKS.md, "How the dev read ran beside the research run")
EVAL_PROCESS_BYTES = 2 * 2**30


def evaluation_parallelism(n_models: int, available_bytes: int, per_process_bytes: int = EVAL_PROCESS_BYTES) -> int:
    """How many evaluations (one policy process each) run side by side: all of them where memory allows, else as
    many as fit in ``available_bytes`` at ``per_process_bytes`` each, and never fewer than one.

    Why a cap: the research profile evaluates eleven models at once (six arms, their 15-iteration adapters and
    SFT); ten at once beside another run took a 23 GB machine's memory and the kernel killed the trainer."""
    return max(1, min(n_models, available_bytes // per_process_bytes))


def available_memory_bytes() -> int:
    """The memory new processes can take now without swapping (Linux's MemAvailable; free pages elsewhere).

    Read here rather than through psutil, which only arrives through wandb: declaring it would re-resolve the four
    hashed locks for one number."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def published_dir(world: str, job: dict) -> str:
    """The directory of the model a finished training job published."""
    return str(registry("model", world).resolve(job["model"]))


def eval_options(method: str, model_dir: str) -> dict:
    """Rollout options of ``method``'s evaluation: its table entry's (the agent's step limit), and as many
    documents per search as the published model was trained with (a model trained on one document per
    subquery reads worse among three)."""
    trained = published_config(model_dir)
    if "topk" not in trained:
        raise SystemExit(f"{model_dir}: its manifest does not say how many documents per search it was trained with")
    return {**get_method(base_method(method)).evaluate, "topk": int(trained["topk"]),
            **reader_settings(method, model_dir, trained)}


def evaluate_method(method: str, model_dir: str, world: str, stack: ServiceStack, questions, run_dir,
                    port_offset: int, adapter: str = "") -> dict:
    """Serve ``model_dir`` (with the LoRA ``adapter`` name@version loaded and active, when given) in its own policy
    process and evaluate it through the services. The process never restores another run's active adapter."""
    kw = eval_options(method, model_dir)
    # an evaluation of the same weights on the same questions by the same code is read back (prorag_app.memo)
    adapter_sha = weights_sha256(registry("adapter", world).resolve(adapter)) if adapter else ""
    key = memo.memo_key("eval", {"method": method, "model": weights_sha256(model_dir), "adapter": adapter_sha,
                                 "options": kw, "corpus": memo.corpus_fingerprint(world),
                                 "questions": memo.questions_fingerprint(questions)})
    out_dir = Path(run_dir) / method
    cached = memo.load("eval", key, into=out_dir)
    if cached is not None:
        console.print(f"eval {method}: reusing the evaluation of the same weights and questions ({key})")
        return cached
    eval_stack = ServiceStack(port_offset=port_offset, world=world, services=("policy",),
                              overrides={"policy": {"model": model_dir, "retriever": stack.grpc_target("retriever"),
                                                    "max_steps": max(64, kw.get("max_steps", 0)),
                                                    "restore_active": False}},
                              log_dir=str(run_dir / "logs" / method))
    with eval_stack, PolicyClient(eval_stack.grpc_target("policy")) as policy, \
            RetrieverClient(stack.grpc_target("retriever"), timeout=600) as retriever, progress_bars() as progress:
        if adapter:
            name, _, version = adapter.partition("@")
            acks = push_adapter([eval_stack.grpc_target("policy")], name, version)
            if not all(a.ok for a in acks):
                raise SystemExit(f"evaluating {method}: the policy did not load adapter {adapter}: "
                                 + "; ".join(a.error for a in acks))
            kw["adapter"] = adapter  # every rollout names it, so a trajectory says which version answered
        result = evaluate(method, policy, retriever, questions, out_dir=run_dir,
                          progress=lambda d, t: progress(f"eval {method}", d, t), **kw)
    memo.store("eval", key, result, [out_dir / "predictions.jsonl", out_dir / "scores.json"])
    return result


def evaluate_methods(models: dict[str, str], world: str, stack: ServiceStack, questions, run_dir,
                     port_offset: int, timings: dict | None = None,
                     adapters: dict[str, str] | None = None) -> dict[str, dict]:
    """Evaluate the methods side by side, each served by its own policy process (ports port_offset + 10 * i), as
    many at once as the memory available now holds (evaluation_parallelism).

    Why side by side: each evaluation starts a policy process (imports, model load) and waits on retrieval
    between decoding rounds; overlapped, three evaluations took less wall time than one after another
    (docs/BENCHMARKS.md). Returns method -> result in the order of ``models``; timings gets eval_<method>_s."""
    timings = {} if timings is None else timings
    available = available_memory_bytes()
    parallel = evaluation_parallelism(len(models), available)
    if parallel < len(models):
        console.print(f"[dim]evaluating {len(models)} models {parallel} at a time: the memory available "
                      f"({available / 2**30:.1f} GiB) holds {parallel} policy processes of up to "
                      f"{EVAL_PROCESS_BYTES / 2**30:.0f} GiB[/dim]")

    def one(i: int, method: str) -> dict:
        with timed(timings, f"eval_{method}_s"):
            return evaluate_method(method, models[method], world, stack, questions, run_dir, port_offset + 10 * i,
                                   adapter=(adapters or {}).get(method, ""))

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {m: pool.submit(one, i, m) for i, m in enumerate(models)}
        return {m: f.result() for m, f in futures.items()}


def stage2(prof: Profile, stack: ServiceStack, world: str, sft_model: str, run_dir, port_offset: int,
           timings: dict, policy_replicas: int = 1) -> dict:
    """Stage 2 on the trained agent: a policy serving it in ``policy_replicas`` processes (started once a search job
    is submitted: none when they are all finished), then prorag_app.stage2.run_stage2."""
    settings = from_dict(Stage2Settings, prof.stage2)
    serving = OnDemand(ServiceStack(port_offset=port_offset, world=world, services=("policy",),
                                    overrides={"policy": {"model": sft_model,
                                                          "retriever": stack.grpc_target("retriever")}},
                                    log_dir=str(run_dir / "logs" / "stage2-policy"),
                                    replicas={"policy": policy_replicas}))
    with timed(timings, "stage2_s"), serving:
        out = run_stage2(stack, serving.grpc_target("policy"), world, sft_model, prof.sft_for("sft"), settings,
                         run_dir, f"{world}-stage2", timings, before_search=serving.need)
    if "auc_gold_vs_corrupted" in out:
        print_prm_families(out)
    return out


def stage34(prof: Profile, stack: ServiceStack, world: str, sft_ref: str, prm: dict | None, questions, run_dir,
            port_offset: int, timings: dict, deep=(), heldout=(), policy_replicas: int = 1
            ) -> tuple[dict, dict[str, dict], dict[str, dict], dict[str, dict]]:
    """Stages 3-4 and the outcome-only baseline from the trained agent (prorag_app.stage34), then their evaluation
    side by side on ``questions``, and with the SFT agent on the ``deep`` questions (under run_dir/deep) and the
    ``heldout`` ones (under run_dir/heldout); policy_replicas: processes of each policy the jobs sample from. Returns
    (what stage34 did, method -> evaluation, method -> evaluation on the deep questions, the same on the held-out
    ones)."""
    settings = from_dict(Stage34Settings, prof.stage34)
    prm_dir = (str(registry("prm", world).resolve(prm["model"])) if prm is not None and "model" in prm else None)
    sft_dir = str(registry("model", world).resolve(sft_ref))
    deep_scores, heldout_scores = {}, {}
    with timed(timings, "stage34_s"):
        out = run_stage34(stack, world, sft_ref, sft_dir, prm_dir, prof.sft_for("sft"), settings, run_dir,
                          port_offset + 200, timings, pairs_path=(prm or {}).get("pairs_path"),
                          prm_gate=(prm or {}).get("gate"), policy_replicas=policy_replicas)
        models = out["models"]
        adapters = {m: v["adapter"] for m, v in models.items()}
        evaluated = evaluate_methods({m: v["model"] for m, v in models.items()}, world, stack, questions, run_dir,
                                     port_offset + 100, timings, adapters=adapters)
        # the RL adapters of earlier iterations too: the data-efficiency curve then counts the deep questions
        deep_models = {"sft": sft_dir, **{m: v["model"] for m, v in models.items()}}
        if deep:
            with timed(timings, "eval_deep_s"):
                deep_scores = evaluate_methods(deep_models, world, stack, list(deep), Path(run_dir) / "deep",
                                               port_offset + 100, adapters=adapters)
        if heldout:
            with timed(timings, "eval_heldout_s"):
                heldout_scores = evaluate_methods(deep_models, world, stack, list(heldout), Path(run_dir) / "heldout",
                                                  port_offset + 100, adapters=adapters)
    return out, evaluated, deep_scores, heldout_scores


def compare(run_dir, methods, questions, parts: tuple[str, ...] = ("", "deep")) -> dict:
    """results.json's "comparisons": paired differences on 3+ hop questions (prorag.evaluation.compare_methods)
    between the methods this run evaluated (one seed), over the evaluations under ``parts`` of run_dir together
    (by default the test split and the deep split, run_dir/deep, where evaluated; question ids differ between
    them; ("heldout",): the held-out split alone)."""
    per_question: dict[str, list[dict[str, float]]] = {}
    for part in parts:
        for m, runs in per_question_f1(Path(run_dir) / part, methods).items():
            per_question[m] = [{**a, **b} for a, b in zip(per_question[m], runs)] if m in per_question else runs
    return compare_methods(per_question, {q.id: q.hops for q in questions}, COMPARISONS)


def copy_probes(models: dict[str, str], questions) -> dict[str, dict]:
    """The name-copy probe (prorag.probes) of each model directory, on the split's question entities."""
    names = [e for e in dict.fromkeys(question_entity(q) for q in questions) if e]
    out = {}
    for name, model_dir in models.items():
        model, tokenizer = load_policy(model_dir)
        out[name] = name_copy_accuracy(model, tokenizer, names)
    return out


def diagnostics(methods: dict[str, dict], probes: dict[str, dict], errors: dict | None = None) -> dict[str, dict]:
    """Per method (and the base): format-valid rate, how often the agent's first subquery names the question's
    entity, the copy probe, and why its 3+ hop answers are wrong (prorag_app.report.error_counts' {"n", "counts"};
    where the world's questions carry gold chains); what makes the next failure visible before F1 does."""
    out = {"base": {"copy_probe": probes["base"]}} if "base" in probes else {}
    for m, r in methods.items():
        out[m] = {"format_valid_rate": r.get("format_valid_rate"),
                  "first_subquery_entity_rate": r.get("first_subquery_entity_rate"), "copy_probe": probes.get(m),
                  **({"answer_errors": errors[m]} if errors and m in errors else {})}
    return out


def multi_hop_figure(methods: dict) -> dict | None:
    """Issue #4's figure from evaluated methods: sft vs standard_rag on 2+ hop questions (None when
    either is missing or the split has no multi-hop question)."""
    sft, rag = methods.get("sft", {}).get("multi_hop"), methods.get("standard_rag", {}).get("multi_hop")
    if not sft or not rag:
        return None
    return {"group": f"{MULTI_HOP_MIN}+ hops", "sft_f1": sft["f1"], "sft_f1_ci": sft["f1_ci"],
            "standard_rag_f1": rag["f1"], "standard_rag_f1_ci": rag["f1_ci"], **margin_beyond_cis(sft, rag)}


def deep_questions(world: str, prof: Profile) -> list:
    """The world's extra split of 3+ hop questions that ``prof`` asks for (built when missing; a dev run gets its
    own, drawn after the test one and disjoint from it); [] when it asks for none."""
    if not prof.deep_questions:
        return []
    n = (prof.dev_deep_questions or prof.deep_questions) if prof.eval_split == "dev" else prof.deep_questions
    ensure_deep_split(paths.world_dir(world), n, prof.eval_split, test_n=prof.deep_questions)
    return load_split(paths.world_dir(world), DEEP_SPLITS[prof.eval_split])


def heldout_questions(world: str, prof: Profile) -> list:
    """The world's held-out split of 3+ hop questions that ``prof`` asks for (built when missing, after the deep
    splits); [] when it asks for none or the run evaluates on dev, which never reads it."""
    if not prof.heldout_questions or prof.eval_split != "test":
        return []
    ensure_heldout_split(paths.world_dir(world), prof.heldout_questions, test_n=prof.deep_questions,
                         dev_n=prof.dev_deep_questions or prof.deep_questions)
    return load_split(paths.world_dir(world), HELDOUT_DEEP_SPLIT)


def ensure_rl_questions(world: str, prof: Profile) -> None:
    """The world's RL split (questions held out of SFT) that ``prof`` trains RL on, built when missing after the deep
    and held-out splits (with their sizes on disk, else the profile's); nothing when it asks for none."""
    if prof.rl_questions:
        ensure_rl_split(paths.world_dir(world), prof.rl_questions, test_n=prof.deep_questions,
                        dev_n=prof.dev_deep_questions or prof.deep_questions,
                        heldout_n=prof.heldout_questions or HELDOUT_QUESTIONS,
                        split=(prof.stage34 or {}).get("rl", {}).get("split", RL_SPLIT), rl_deep_n=RL_QUESTIONS)


def run_main_job(profile: str = "default", world: str | None = None, port_offset: int = 0,
                 stage34_seed: int | None = None, beta: float | None = None, prof: Profile | None = None,
                 policy_replicas: int = 0) -> dict:
    """`prorag run`: the profile named ``profile`` (or ``prof``, reported under that name) on its world or
    ``world``; returns what results.json holds, its phases timed in order under "timings". policy_replicas:
    processes of the policy that stages 2-4 sample from (0 = prorag_app.stack.default_policy_replicas); how fast,
    not what: the jobs and their samples do not depend on it."""
    prof = with_stage34(prof or PROFILES[profile], stage34_seed, beta)
    policy_replicas = policy_replicas or default_policy_replicas()
    world = world or prof.world
    timings: dict[str, float] = {}
    started = time.monotonic()
    with timed(timings, "build_world_indexes_model_s"):
        ensure_indexes(world)
        with progress_bars() as progress:
            base = ensure_policy_model(world, preset=prof.model_preset, vocab_size=prof.vocab_size,
                                       progress=progress, warmup=prof.base_warmup, variant=prof.base_variant,
                                       source=prof.base_source, say=console.print)
    run_dir = new_run_dir(f"run-{profile.replace('/', '-')}" + ("-dev" if prof.eval_split == "dev" else ""))
    test = load_split(paths.world_dir(world), prof.eval_split)
    eval_qs = test[:prof.eval_questions] if prof.eval_questions else test
    trained = prof.trained_methods
    parallel, threads = training_parallelism(len(trained))
    prm, stage34_out, comparisons, deep, deep_scores = None, None, {}, [], {}
    heldout, heldout_scores, heldout_comparisons = [], {}, {}
    with contextlib.ExitStack() as running:
        with timed(timings, "start_services_s"):
            stack = running.enter_context(ServiceStack(
                port_offset=port_offset, world=world, log_dir=str(run_dir / "logs" / "stack"),
                overrides={"policy": {"model": str(base)}, "trainer": {"parallel_jobs": parallel}}))
        with timed(timings, "evaluate_retrieval_s"), RetrieverClient(stack.grpc_target("retriever")) as client:
            retrieval = evaluate_retrieval(client, test)
        print_retrieval_table(retrieval, KS)
        with timed(timings, "train_all_s"):
            # the agent's job is the longest: started first, the baselines share the other worker(s) meanwhile
            order = sorted(trained, key=lambda m: prof.sft_for(m).get("mode") != "agent")
            jobs = train_methods(stack, order, prof, str(base), world, threads=threads)
        timings.update({f"train_{method}_s": jobs[method]["train_s"] for method in trained})
        with timed(timings, "eval_all_s"):
            methods = evaluate_methods({m: published_dir(world, jobs[prof.model_of(m)]) for m in prof.methods},
                                       world, stack, eval_qs, run_dir, port_offset + 100, timings)
        console.print(format_table(methods, prof.eval_split))
        if prof.stage2 is not None and "sft" in jobs:
            prm = stage2(prof, stack, world, published_dir(world, jobs["sft"]), run_dir, port_offset + 100, timings,
                         policy_replicas=policy_replicas)
        if prof.stage34 is not None and "sft" in jobs:
            deep, heldout = deep_questions(world, prof), heldout_questions(world, prof)
            ensure_rl_questions(world, prof)
            stage34_out, later, deep_scores, heldout_scores = stage34(
                prof, stack, world, jobs["sft"]["model"], prm, eval_qs, run_dir, port_offset, timings, deep=deep,
                heldout=heldout, policy_replicas=policy_replicas)
            methods.update(later)
            comparisons = compare(run_dir, methods, [*eval_qs, *deep])
            if heldout:
                heldout_comparisons = compare(run_dir, methods, heldout, parts=("heldout",))
    with timed(timings, "diagnostics_s"):
        probes = copy_probes({"base": str(base), **{m: published_dir(world, jobs[m]) for m in methods if m in jobs}},
                             test)
        errors = answer_errors_of(run_dir, world, methods)
        diag = diagnostics(methods, probes, errors)
    print_diagnostics(diag)
    print_answer_errors(errors)
    if stage34_out is not None:
        print_stage34(methods, stage34_out, comparisons, prof.eval_split)
        if heldout_comparisons:
            print_comparisons(heldout_comparisons, f"held-out ({len(heldout)} questions of 3+ hops)")
    figure = multi_hop_figure(methods)
    print_figure(figure)
    results = {
        "methods": {m: {**{k: v for k, v in r.items()
                           if k in ("overall", "by_hops", "by_type", "multi_hop", "format_valid_rate",
                                    "first_subquery_entity_rate")},
                        **({"reader": prof.model_of(m)} if prof.model_of(m) != m else {})}
                    for m, r in methods.items()},
        "figure": figure,
        **({"prm": prm} if prm is not None else {}),
        **({"comparisons": comparisons, "stage34": stage34_out} if stage34_out is not None else {}),
        # the stage 3-4 methods and the SFT agent on the world's extra split of 3+ hop questions
        **({"deep": {"questions": len(deep), "methods": {m: {k: r[k] for k in ("overall", "by_hops")}
                                                         for m, r in deep_scores.items()}}}
           if stage34_out is not None and deep else {}),
        # the same on the held-out split (issue 47), compared on it alone: the figures read once at the end
        **({"heldout": {"questions": len(heldout), "comparisons": heldout_comparisons,
                        "methods": {m: {k: r[k] for k in ("overall", "by_hops")} for m, r in heldout_scores.items()}}}
           if stage34_out is not None and heldout else {}),
        "diagnostics": diag,
        "retrieval": retrieval,
        "jobs": {m: {"job_id": j["job_id"], "model": j["model"], "metrics": j["metrics"]} for m, j in jobs.items()},
        "profile": profile,
        "split": prof.eval_split,
        "run_dir": str(run_dir),
        "world": world,
        "base_model": str(base),
        "code_version": code_version(),
        "timings": timings,
        "policy_replicas": policy_replicas,  # processes of the policy stages 2-4 sampled from
        "total_s": time.monotonic() - started,
    }
    path = write_results(run_dir, results)
    console.print(f"results: {path} (runs/latest/results.json)")
    # the run's report beside its results: runs/latest/report/index.html opens from disk in a browser
    console.print(f"html report: {build_report([run_dir], run_dir / 'report')['html']}")
    console.print(json.dumps({k: round(v, 1) for k, v in timings.items()}))
    return results


# ---------------------------------------------------------------- the ablation report
def run_ablation(plan: AblationPlan = ABLATION, world: str | None = None, port_offset: int = 0, split: str = "test",
                 overrides: tuple[str, ...] = (), policy_replicas: int = 0) -> dict:
    """Every run of ``plan`` on ``split`` with ``overrides`` (`--set`) applied (each run reusing what earlier runs
    trained: the SFT agent, stage 2, RFT, the pool), then one report over them in a new run directory; returns the
    report (prorag_app.report.build_report). policy_replicas: as run_main_job's."""
    base = with_overrides(dataclasses.replace(PROFILES[plan.profile], eval_split=split), overrides)
    if base.stage34 is None:
        raise InvalidArgument(f"profile {plan.profile!r} has no stages 3-4 to ablate")
    run_dirs = []
    if plan.methods:  # what the plan compares, whatever the profile leaves out for time
        base = dataclasses.replace(base, stage34={**base.stage34, "methods": tuple(plan.methods)})
    for k, seed in enumerate(plan.seeds):
        prof = with_stage34(base, seed)
        if k == 0:
            methods = tuple(dict.fromkeys((*prof.stage34.get("methods", ("rft", "prorag", "outcome_grpo",
                                                                        "reasonrag")), "prorag_no_rft")))
            extra = {"eval_iterations": tuple(plan.eval_iterations)} if plan.eval_iterations else {}
            prof = dataclasses.replace(prof, stage34={**prof.stage34, "methods": methods, **extra})
        run_dirs.append(run_main_job(f"{plan.name}/seed{seed}", world, port_offset, prof=prof,
                                     policy_replicas=policy_replicas)["run_dir"])
    for beta in plan.betas:
        prof = with_stage34(base, plan.seeds[0] if plan.seeds else None, beta)
        prof = dataclasses.replace(prof, stage34={**prof.stage34, "methods": ("prorag",)})
        run_dirs.append(run_main_job(f"{plan.name}/beta{beta}", world, port_offset, prof=prof,
                                     policy_replicas=policy_replicas)["run_dir"])
    out = new_run_dir(f"{plan.name}-report")
    report = build_report(run_dirs, out)
    point_latest(out)
    console.print((out / "report.md").read_text())
    console.print(f"report: {out / 'report.md'}")
    if report.get("html"):
        console.print(f"html report: {report['html']}")
    return report
