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

import dataclasses
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prorag import paths
from prorag.rpc.clients import PolicyClient, RetrieverClient
from prorag.data.loaders import load_split
from prorag_app.embedded import ensure_indexes, ensure_policy_model
from prorag.progress import progress_bars
from prorag.evaluation import grouped_mean_ci, recall_at_k, retrieval_queries
from prorag.errors import InvalidArgument
from prorag.methods import base_method, get_method
from prorag.registry import registry
from prorag.runs import code_version, new_run_dir, write_results
from prorag_app.stack import ServiceStack

KS = (1, 3, 5, 10)
INDEXES = ("dense", "bm25", "hybrid")
console = Console()


@dataclass(frozen=True)
class Profile:
    """What `make run` trains and evaluates; `tiny` is what the end-to-end test runs.

    Typed: at definition every method must be in the method table, every SFT setting a valid SFTConfig
    field and value, every warm-up setting a valid WarmupConfig one, so a typo fails at import, not an
    hour into a run."""

    world: str
    model_preset: str
    vocab_size: int
    sft: dict                      # SFT job settings shared by the policy and the baselines
    eval_questions: int = 0        # 0 = the whole test split
    methods: tuple[str, ...] = ("no_retrieval", "standard_rag", "sft")
    base_warmup: dict | None = None  # base warm-up (WarmupConfig overrides); None = the world's default base
    base_variant: str = ""           # directory suffix of a base other than the world's default
    method_sft: dict = field(default_factory=dict)  # {method: SFT settings on top of ``sft`` for that method only}
    stage2: dict | None = None  # MCTS, judging, PRM and its validation (prorag_app.stage2.Stage2Settings); None = off
    stage34: dict | None = None  # RFT, ProRAG's RL and outcome-only GRPO (prorag_app.stage34.Stage34Settings)
    #: questions of the world's extra 3+ hop split (prorag.data.world.ensure_deep_split) on which the SFT agent
    #: and the stage 3-4 methods are also evaluated, so their paired comparisons see enough deep questions
    deep_questions: int = 0
    #: the split methods are evaluated and compared on: test for reported figures, dev for choosing settings
    #: (`prorag run --split dev`, with the dev deep split: drawn after the test one, sharing no question with it)
    eval_split: str = "test"

    def __post_init__(self) -> None:
        from prorag.config import check_fields
        from prorag.modeling import WarmupConfig
        from services.trainer.stage_sft import SFTConfig

        for m in self.methods:
            method = get_method(m)
            if method.reader and method.reader not in self.methods:
                raise InvalidArgument(f"profile method {m!r} reads with {method.reader!r}'s model: list "
                                      f"{method.reader!r} in the profile's methods too")
        for m in (*(m for m in self.methods if not get_method(m).reader), *self.method_sft):
            if get_method(m).stage != "sft":
                what = (f"reads with {get_method(m).reader!r}'s model and is not trained" if get_method(m).reader
                        else f"is trained by stage {get_method(m).stage!r}")
                raise InvalidArgument(f"profile method {m!r} {what}, not SFT: stages 3-4 are asked for by the "
                                      "profile's stage34 settings")
        if self.eval_split not in ("test", "dev"):
            raise InvalidArgument(f"eval_split: {self.eval_split!r} is not test or dev")
        check_fields(SFTConfig, self.sft, prefix="sft.")
        for m, settings in self.method_sft.items():
            check_fields(SFTConfig, settings, prefix=f"method_sft.{m}.")
        if self.base_warmup is not None:
            check_fields(WarmupConfig, self.base_warmup, prefix="base_warmup.")
        if self.stage2 is not None:
            from prorag.search.mcts import MCTSConfig
            from prorag_app.stage2 import Stage2Settings
            from services.trainer.stage_mcts import MCTSStageConfig
            from services.trainer.stage_prm import PRMConfig

            from services.trainer.stage_siblings import SiblingsStageConfig

            check_fields(Stage2Settings, {k: v for k, v in self.stage2.items()
                                          if k not in ("mcts", "prm", "siblings")}, prefix="stage2.")
            check_fields(SiblingsStageConfig, self.stage2.get("siblings", {}), prefix="stage2.siblings.")
            mcts = dict(self.stage2.get("mcts", {}))
            check_fields(MCTSConfig, mcts.pop("mcts", {}), prefix="stage2.mcts.mcts.")
            check_fields(MCTSStageConfig, mcts, prefix="stage2.mcts.")
            check_fields(PRMConfig, self.stage2.get("prm", {}), prefix="stage2.prm.")
        if self.stage34 is not None:
            from prorag_app.stage34 import Stage34Settings
            from services.trainer.stage_rft import RFTConfig
            from services.trainer.stage_rl import RLConfig

            from services.trainer.stage_rlpool import RLPoolConfig

            check_fields(Stage34Settings, {k: v for k, v in self.stage34.items()
                                           if k not in ("rft", "rl", "dpo", "pool")}, prefix="stage34.")
            check_fields(RLPoolConfig, self.stage34.get("pool", {}), prefix="stage34.pool.")
            for m in self.stage34.get("methods", ()):
                if get_method(m).stage not in ("rft", "rl", "dpo"):
                    raise InvalidArgument(f"stage34.methods: {m!r} is not a stage 3-4 method")
            check_fields(RFTConfig, self.stage34.get("rft", {}), prefix="stage34.rft.")
            check_fields(RLConfig, self.stage34.get("rl", {}), prefix="stage34.rl.")
            from services.trainer.stage_dpo import DPOConfig

            check_fields(DPOConfig, self.stage34.get("dpo", {}), prefix="stage34.dpo.")

    @property
    def trained_methods(self) -> tuple[str, ...]:
        """The methods the SFT stage trains (the others read with one of these models)."""
        return tuple(m for m in self.methods if get_method(m).stage == "sft")

    def model_of(self, method: str) -> str:
        """The trained method whose model ``method`` is evaluated with (itself, or its reader)."""
        return get_method(base_method(method)).reader or method

    def sft_for(self, method: str) -> dict:
        """The SFT job settings of ``method``: its table entry's, the profile's shared ones, then its own."""
        return {**get_method(method).train, **self.sft, **self.method_sft.get(method, {})}


#: The recipe that reaches the SFT figure (docs/BENCHMARKS.md, "One document per subquery, 1,200 SFT steps,
#: canonical subqueries" and "The SFT figure on worlds built with other seeds"): the default world's base
#: (prorag_app.embedded: the induction-wired `cpu-induction` preset with the gap and paraphrase warm-up phases),
#: restated questions, plan-carrying thoughts, 1,200 SFT steps over the whole train split for the agent and the
#: no-retrieval baseline, the agent reading one document per subquery written in its relation's one phrasing, and
#: standard RAG reading with the agent's model (one search with the question). standard_rag_ft, the separately
#: fine-tuned standard RAG (also trained on each gold hop's reading sample), is not in the default methods: its
#: reading depended on the world (docs/BENCHMARKS.md).
RECIPE = Profile(world="default", model_preset="cpu-induction", vocab_size=8192,
                 sft={"max_questions": 0, "max_steps": 1200, "batch_size": 8, "lr": 3e-3, "log_every": 10,
                      "checkpoint_every": 200, "restate_question": True, "plan_thoughts": True},
                 # the agent reads one document per subquery: the top-1 of the default (hybrid) index holds a
                 # gold sub-question's document 98.6% of the time, and the small policy reads one document far
                 # better than three; and it writes each relation's subquery one way (dev 2+ hops 32.1 -> 51.1)
                 method_sft={"sft": {"topk": 1, "canonical_subqueries": True},
                             # when trained (not by default): also on each gold hop's answer read out of its
                             # documents, as the agent's subanswers are, from the one top document the agent reads
                             "standard_rag_ft": {"hop_samples": True, "topk": 1}},
                 # stage 2 on the trained agent: MCTS on 200 train questions (ProRAG: 200 simulations x 5
                 # expansions on 728; cut to what 2 cores finish in minutes), pairs labelled by the reference judge,
                 # the PRM (Bradley-Terry) on them, validated on 250 questions of the split (the gate reads it)
                 stage2={"mcts": {"max_questions": 200, "concurrency": 32, "max_step_tokens": 96, "seed": 1,
                                  "mcts": {"simulations": 12, "expansions": 4, "max_children": 4}},
                         "prm": {"epochs": 2, "batch_size": 8, "lr": 5e-4, "label_source": "judge"},
                         # every corruption family on 250 questions (the whole split: 2.5x the cases of the four
                         # in-distribution families, whose validation took 134 s; an estimate, not measured)
                         "eval_questions": 250},
                 # stages 3-4 and outcome-only GRPO from the same agent, with the same RL questions, iterations,
                 # group size and learning rate for both RL methods (sized for 2 cores; docs/BENCHMARKS.md)
                 # RFT as the reference does it (RFTConfig's defaults: per step, questions even over hop counts):
                 # every correct trajectory, the loss on its steps among the PRM's better half (a Bradley-Terry
                 # PRM's logits carry an offset, so a fixed threshold 0 kept nothing); one gold SFT trajectory
                 # replayed per kept one at a 5x lower rate (docs/BENCHMARKS.md: RFT alone taught stopping early)
                 # the headline is ProRAG without RFT against outcome GRPO (the same start, questions and budget);
                 # the full ProRAG (RFT first) and ReasonRAG beside it (issue 30)
                 stage34={"methods": ("rft", "prorag", "outcome_grpo", "prorag_no_rft", "reasonrag"),
                          "rft": {"max_questions": 400, "samples_per_question": 4, "temperature": 0.8,
                                  "max_step_tokens": 96, "batch_size": 8, "lr": 1e-4, "replay": 1.0, "seed": 1,
                                  "prm_keep_fraction": 0.5},
                          "rl": {"iterations": 10, "questions_per_iteration": 16, "group_size": 8, "lr": 5e-4,
                                 "max_step_tokens": 96, "checkpoint_every": 5, "seed": 1},
                          # ReasonRAG: DPO on the value-labelled pairs of the same MCTS trees, at the RL methods'
                          # learning rate (its 1 epoch at 1e-6 is for full fine-tuning of a 7B model)
                          "dpo": {"epochs": 3, "batch_size": 8, "lr": 5e-4, "seed": 1},
                          "beta": 0.3},
                 # with the test split's 175 questions of 3+ hops, 625 for the stage 3-4 comparisons (issue 19: 600)
                 deep_questions=450)

PROFILES = {
    "tiny": Profile(world="tiny", model_preset="tiny", vocab_size=2048,
                    sft={"max_steps": 24, "batch_size": 8, "lr": 3e-3, "log_every": 4, "checkpoint_every": 12},
                    stage2={"mcts": {"max_questions": 6, "concurrency": 3, "max_step_tokens": 64, "seed": 1,
                                     "mcts": {"simulations": 4, "expansions": 2, "max_children": 2, "max_depth": 6}},
                            "prm": {"epochs": 1, "batch_size": 4, "log_every": 1, "checkpoint_every": 10,
                                    "label_source": "judge"},
                            "eval_questions": 20},
                    stage34={"rft": {"max_questions": 8, "samples_per_question": 2, "max_step_tokens": 32,
                                     "max_train_steps": 2, "batch_size": 2, "checkpoint_every": 1},
                             "rl": {"iterations": 2, "questions_per_iteration": 4, "group_size": 2,
                                    "max_step_tokens": 32, "max_steps": 4, "lr": 1e-3, "lora_r": 4, "lora_alpha": 8,
                                    "checkpoint_every": 1},
                             "dpo": {"epochs": 1, "batch_size": 4, "lora_r": 4, "lora_alpha": 8}},
                    deep_questions=8),
    "default": RECIPE,
    # stage 1 of the recipe alone: the agent and standard RAG read by it, no stages 2-4 (~25 minutes on 2 cores);
    # what the SFT figure on worlds built with other seeds is measured with
    "stage1": dataclasses.replace(RECIPE, methods=("standard_rag", "sft"), stage2=None, stage34=None),
    # the name the recipe had while it was not the default; outside scripts call it
    "full": RECIPE,
    # The earlier default, sized for a 20-minute budget (~12 minutes): the plain `cpu` base warmed up by the copy
    # task and reading curriculum only, 240 SFT steps over 3,000 questions. Its agent does not reach the figure
    # (test F1 1.3-1.8, docs/BENCHMARKS.md); kept for quick checks of the whole pipeline.
    "quick": Profile(world="default", model_preset="cpu", vocab_size=8192, base_warmup={}, base_variant="quick",
                     sft={"max_questions": 3000, "max_steps": 240, "batch_size": 8, "lr": 3e-3, "log_every": 10,
                          "checkpoint_every": 60}),
}

#: issue 30's experiment, sized for hours rather than `make run`'s hour (`prorag run --profile research` runs it over
#: RESEARCH's three stage 3-4 seeds, then `prorag report`; a single seed with --stage34-seed). Each choice and why:
#: - pairs that contain reading: the sibling sampler on 2,000 train questions beside the MCTS trees (stage 2's PRM
#:   saw ~100 judged pairs per run before), the PRM validated on the whole split, and the gate enforced: a PRM below
#:   it guides nothing and the report says so;
#: - the same start for the headline: outcome GRPO and ProRAG without RFT both from the SFT agent, on one learnable
#:   pool (3+ hop train questions the SFT agent sometimes answers: 78-86% of deep groups had no right answer);
#: - a budget RL can learn in: 100 iterations of 16 questions (the default profile runs 10);
#: - the oracle ceiling (prorag_oracle) beside them, a diagnostic and never a headline;
#: - RFT as the reference does it (per step, questions even over hop counts).
RESEARCH_PROFILE = dataclasses.replace(
    RECIPE,
    stage2={**RECIPE.stage2,
            "siblings": {"max_questions": 2000, "samples": 4, "concurrency": 32, "max_step_tokens": 96,
                         "max_steps": 10, "seed": 1},
            "eval_questions": 0},
    stage34={**RECIPE.stage34,
             "methods": ("rft", "prorag", "outcome_grpo", "prorag_no_rft", "prorag_oracle", "reasonrag"),
             "rft": {**RECIPE.stage34["rft"], "filter": "step", "hop_balanced": True},
             "rl": {**RECIPE.stage34["rl"], "iterations": 100, "min_hops": 3, "checkpoint_every": 10,
                    "prm_centering": "per_kind"},
             "pool": {"samples": 8, "max_questions": 1500},
             "eval_iterations": (33,),  # a third of the RL questions: the data-efficiency point
             "prm_gate": "enforce"})
PROFILES["research"] = RESEARCH_PROFILE


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


def print_retrieval_table(results: dict, ks=KS) -> None:
    for name, title in (("subquery", "gold sub-question per hop (what a step-by-step agent searches)"),
                        ("question", "whole question (what standard RAG searches)")):
        table = Table(title=f"Retrieval recall@k: {title}")
        table.add_column("index")
        table.add_column("group")
        for k in ks:
            table.add_column(f"R@{k}", justify="right")
        table.add_column("n", justify="right")
        for index, res in results.items():
            cells = res[name]
            for g in cells[f"recall@{ks[0]}"]:
                table.add_row(index, g, *[f"{cells[f'recall@{k}'][g]['mean']:.3f}" for k in ks],
                              str(cells[f"recall@{ks[0]}"][g]["n"]))
            table.add_section()
        console.print(table)


# ---------------------------------------------------------------- training through the trainer
#: bumped when a finished job's outputs change shape, so older jobs are not reused (2: Job.outputs["model"])
JOB_FORMAT = 2


def job_id_for(world: str, method: str, config: dict) -> str:
    """Same config and base weights -> same job id, so a second `make run` reuses the finished job,
    while a rebuilt base (same path, new weights) trains anew. The retriever address is excluded:
    it moves with --port-offset but does not change the data. JOB_FORMAT changes the ids when what a job
    leaves behind changes (jobs finished before the registry name no model in their outputs)."""
    from prorag.registry import weights_sha256

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
    from prorag.rpc.clients_trainer import TrainerClient, state_name

    ids, fresh = {}, []
    with TrainerClient(stack.grpc_target("trainer"), timeout=60) as client:
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
            began: dict[str, float] = {}
            seconds = {m: 0.0 for m in methods}

            def watch(method: str) -> None:
                try:
                    with TrainerClient(stack.grpc_target("trainer"), timeout=60) as own:
                        for ev in own.watch(ids[method]):
                            if state_name(ev.state) == "RUNNING":
                                began.setdefault(method, time.monotonic())
                            if ev.total_steps:
                                progress(f"train {method}", int(ev.step), int(ev.total_steps))
                            if ev.message and not ev.message.startswith("checkpoint"):
                                console.print(f"[dim]{method}: {ev.message[:200]}[/dim]")
                            if state_name(ev.state) in ("SUCCEEDED", "FAILED", "CANCELLED"):
                                if method in began:
                                    seconds[method] = time.monotonic() - began[method]
                                break
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


def train(stack: ServiceStack, method: str, profile: Profile, base_model: str, world: str) -> dict:
    """Run (or reuse) the training job of one method (:func:`train_methods`)."""
    return train_methods(stack, [method], profile, base_model, world)[method]


def eval_options(method: str, model_dir: str) -> dict:
    """Rollout options of ``method``'s evaluation: its table entry's (the agent's step limit), and as many
    documents per search as the published model was trained with (a model trained on one document per
    subquery reads worse among three)."""
    from prorag.registry import published_config

    trained = published_config(model_dir)
    if "topk" not in trained:
        raise SystemExit(f"{model_dir}: its manifest does not say how many documents per search it was trained with")
    from prorag_app.eval import reader_settings

    return {**get_method(base_method(method)).evaluate, "topk": int(trained["topk"]),
            **reader_settings(method, model_dir, trained)}


def evaluate_method(method: str, model_dir: str, world: str, stack: ServiceStack, questions, run_dir,
                    port_offset: int, adapter: str = "") -> dict:
    """Serve ``model_dir`` (with the LoRA ``adapter`` name@version loaded and active, when given) in its own policy
    process and evaluate it through the services. The process never restores another run's active adapter."""
    from prorag.rpc.clients import push_adapter
    from prorag.registry import weights_sha256
    from prorag_app import memo
    from prorag_app.eval import evaluate

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
    """Evaluate every method at once, each served by its own policy process (ports port_offset + 10 * i).

    Why side by side: each evaluation starts a policy process (imports, model load) and waits on retrieval
    between decoding rounds; overlapped, three evaluations took less wall time than one after another
    (docs/BENCHMARKS.md). Returns method -> result in the order of ``models``; timings gets eval_<method>_s."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int, method: str) -> dict:
        t = time.monotonic()
        out = evaluate_method(method, models[method], world, stack, questions, run_dir, port_offset + 10 * i,
                              adapter=(adapters or {}).get(method, ""))
        if timings is not None:
            timings[f"eval_{method}_s"] = time.monotonic() - t
        return out

    with ThreadPoolExecutor(max_workers=len(models)) as pool:
        futures = {m: pool.submit(one, i, m) for i, m in enumerate(models)}
        return {m: f.result() for m, f in futures.items()}


def stage2(prof: Profile, stack: ServiceStack, world: str, sft_model: str, run_dir, port_offset: int,
           timings: dict) -> dict:
    """Stage 2 on the trained agent: a policy process serving it, then prorag_app.stage2.run_stage2."""
    from prorag.config import from_dict
    from prorag_app.eval import print_prm_families
    from prorag_app.stage2 import Stage2Settings, run_stage2

    settings = from_dict(Stage2Settings, prof.stage2)
    t = time.monotonic()
    serving = ServiceStack(port_offset=port_offset, world=world, services=("policy",),
                           overrides={"policy": {"model": sft_model, "retriever": stack.grpc_target("retriever")}},
                           log_dir=str(run_dir / "logs" / "stage2-policy"))
    with serving:
        out = run_stage2(stack, serving.grpc_target("policy"), world, sft_model, prof.sft_for("sft"), settings,
                         run_dir, f"{world}-stage2", timings, split=prof.eval_split)
    timings["stage2_s"] = time.monotonic() - t
    if "auc_gold_vs_corrupted" in out:
        print_prm_families(out)
    return out


def stage34(prof: Profile, stack: ServiceStack, world: str, sft_ref: str, prm: dict | None, questions, run_dir,
            port_offset: int, timings: dict, deep=()) -> tuple[dict, dict[str, dict], dict[str, dict]]:
    """Stages 3-4 and the outcome-only baseline from the trained agent (prorag_app.stage34), then their evaluation
    side by side on ``questions``, and with the SFT agent on the ``deep`` questions (under run_dir/deep).
    Returns (what stage34 did, method -> evaluation, method -> evaluation on the deep questions)."""
    from prorag.config import from_dict
    from prorag_app.stage34 import Stage34Settings, run_stage34

    settings = from_dict(Stage34Settings, prof.stage34)
    prm_dir = (str(registry("prm", world).resolve(prm["model"])) if prm is not None and "model" in prm else None)
    sft_dir = str(registry("model", world).resolve(sft_ref))
    t = time.monotonic()
    out = run_stage34(stack, world, sft_ref, sft_dir, prm_dir, prof.sft_for("sft"), settings, run_dir,
                      port_offset + 200, timings, pairs_path=(prm or {}).get("pairs_path"),
                      prm_gate=(prm or {}).get("gate"))
    models = out["models"]
    evaluated = evaluate_methods({m: v["model"] for m, v in models.items()}, world, stack, questions, run_dir,
                                 port_offset + 100, timings, adapters={m: v["adapter"] for m, v in models.items()})
    deep_scores = {}
    if deep:
        t_deep = time.monotonic()
        # the RL adapters of earlier iterations too: the data-efficiency curve then counts the deep questions
        deep_models = {"sft": sft_dir, **{m: v["model"] for m, v in models.items()}}
        deep_scores = evaluate_methods(deep_models, world, stack, list(deep), Path(run_dir) / "deep",
                                       port_offset + 100, adapters={m: v["adapter"] for m, v in models.items()})
        timings["eval_deep_s"] = time.monotonic() - t_deep
    timings["stage34_s"] = time.monotonic() - t
    return out, evaluated, deep_scores


def compare(run_dir, methods, questions) -> dict:
    """results.json's "comparisons": paired differences on 3+ hop questions (prorag.evaluation.compare_methods)
    between the methods this run evaluated (one seed), over the test split and the deep split together
    (run_dir/deep, where evaluated; question ids differ between the two)."""
    from prorag.evaluation import compare_methods
    from prorag_app.stage34 import COMPARISONS, per_question_f1

    per_question = per_question_f1(run_dir, methods)
    for m, runs in per_question_f1(Path(run_dir) / "deep", methods).items():
        if m in per_question:
            per_question[m] = [{**a, **b} for a, b in zip(per_question[m], runs)]
    return compare_methods(per_question, {q.id: q.hops for q in questions}, COMPARISONS)


def copy_probes(models: dict[str, str], questions) -> dict[str, dict]:
    """The name-copy probe (prorag.probes) of each model directory, on the split's question entities."""
    from prorag.evaluation import question_entity
    from prorag.modeling import load_policy
    from prorag.probes import name_copy_accuracy

    names = [e for e in dict.fromkeys(question_entity(q) for q in questions) if e]
    out = {}
    for name, model_dir in models.items():
        model, tokenizer = load_policy(model_dir)
        out[name] = name_copy_accuracy(model, tokenizer, names)
    return out


def diagnostics(methods: dict[str, dict], probes: dict[str, dict]) -> dict[str, dict]:
    """Per method (and the base): format-valid rate, how often the agent's first subquery names the question's
    entity, and the copy probe; what makes the next failure visible before F1 does."""
    out = {"base": {"copy_probe": probes["base"]}} if "base" in probes else {}
    for m, r in methods.items():
        out[m] = {"format_valid_rate": r.get("format_valid_rate"),
                  "first_subquery_entity_rate": r.get("first_subquery_entity_rate"), "copy_probe": probes.get(m)}
    return out


def print_diagnostics(diag: dict[str, dict]) -> None:
    table = Table(title="Diagnostics: format, the agent's first subquery, copying names read earlier (greedy)")
    for col in ("model", "format-valid", "1st subquery names the entity", "copy probe: names", "tokens"):
        table.add_column(col, justify="left" if col == "model" else "right")

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    for name, d in diag.items():
        probe = d.get("copy_probe") or {}
        table.add_row(name, pct(d.get("format_valid_rate")), pct(d.get("first_subquery_entity_rate")),
                      pct(probe.get("name_accuracy")), pct(probe.get("token_accuracy")))
    console.print(table)


def multi_hop_figure(methods: dict) -> dict | None:
    """Issue #4's figure from evaluated methods: sft vs standard_rag on 2+ hop questions (None when
    either is missing or the split has no multi-hop question)."""
    from prorag.evaluation import MULTI_HOP_MIN, margin_beyond_cis

    sft, rag = methods.get("sft", {}).get("multi_hop"), methods.get("standard_rag", {}).get("multi_hop")
    if not sft or not rag:
        return None
    return {"group": f"{MULTI_HOP_MIN}+ hops", "sft_f1": sft["f1"], "sft_f1_ci": sft["f1_ci"],
            "standard_rag_f1": rag["f1"], "standard_rag_f1_ci": rag["f1_ci"], **margin_beyond_cis(sft, rag)}


def with_stage34(prof: Profile, seed: int | None = None, beta: float | None = None) -> Profile:
    """``prof`` with its stage 3-4 jobs' seed (RFT, RL, DPO) and ProRAG's beta replaced where given: the knobs
    of the headline comparison's seeds and of the beta sweep (``prorag report`` pools such runs)."""
    if prof.stage34 is None or (seed is None and beta is None):
        return prof
    s34 = {k: (dict(v) if isinstance(v, dict) else v) for k, v in prof.stage34.items()}
    if seed is not None:
        for job in ("rft", "rl", "dpo"):
            s34[job] = {**s34.get(job, {}), "seed": int(seed)}
    if beta is not None:
        s34["beta"] = float(beta)
    return dataclasses.replace(prof, stage34=s34)


def with_overrides(prof: Profile, assignments: list[str] | tuple[str, ...]) -> Profile:
    """``prof`` with ``KEY=VALUE`` assignments applied (`prorag run --set`): KEY is a dotted path into the profile
    (``stage34.rft.lr``, ``stage34.methods``), VALUE is JSON (a bare word is taken as a string). The result is
    checked like any profile, so an unknown field or a bad value fails before anything runs."""
    fields_ = {f.name for f in dataclasses.fields(Profile)}
    changes: dict = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        path = [k for k in key.strip().split(".") if k]
        if not sep or not path:
            raise InvalidArgument(f"--set {assignment!r}: write KEY=VALUE, e.g. stage34.rft.lr=1e-4")
        if path[0] not in fields_:
            raise InvalidArgument(f"--set {key}: the profile has no field {path[0]!r} (it has {sorted(fields_)})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = tuple(value)
        if len(path) == 1:
            changes[path[0]] = value
            continue
        root = changes.get(path[0], getattr(prof, path[0]))
        if not isinstance(root, dict):
            raise InvalidArgument(f"--set {key}: profile field {path[0]!r} is not a settings dict")
        root = node = json.loads(json.dumps(root))  # a deep copy: the profile's own dicts stay as they are
        for k in path[1:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise InvalidArgument(f"--set {key}: {k!r} is not a settings dict")
        node[path[-1]] = value
        changes[path[0]] = root
    return dataclasses.replace(prof, **changes) if changes else prof


def run_main_job(profile: str = "default", world: str | None = None, port_offset: int = 0,
                 stage34_seed: int | None = None, beta: float | None = None, prof: Profile | None = None) -> dict:
    """`prorag run`: the profile named ``profile`` (or ``prof``, reported under that name) on its world or
    ``world``; returns what results.json holds."""
    from prorag_app.eval import format_table

    prof = with_stage34(prof or PROFILES[profile], stage34_seed, beta)
    world = world or prof.world
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    ensure_indexes(world)
    with progress_bars() as progress:
        base = ensure_policy_model(world, preset=prof.model_preset, vocab_size=prof.vocab_size, progress=progress,
                                   warmup=prof.base_warmup, variant=prof.base_variant)
    timings["build_world_indexes_model_s"] = time.monotonic() - t0
    run_dir = new_run_dir(f"run-{profile.replace('/', '-')}" + ("-dev" if prof.eval_split == "dev" else ""))
    t1 = time.monotonic()
    test = load_split(paths.world_dir(world), prof.eval_split)
    eval_qs = test[:prof.eval_questions] if prof.eval_questions else test
    methods, jobs = {}, {}
    trained = prof.trained_methods
    parallel, threads = training_parallelism(len(trained))
    with ServiceStack(port_offset=port_offset, world=world, log_dir=str(run_dir / "logs" / "stack"),
                      overrides={"policy": {"model": str(base)}, "trainer": {"parallel_jobs": parallel}}) as stack:
        timings["start_services_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        with RetrieverClient(stack.grpc_target("retriever")) as client:
            retrieval = evaluate_retrieval(client, test)
        timings["evaluate_retrieval_s"] = time.monotonic() - t2
        print_retrieval_table(retrieval)
        t3 = time.monotonic()
        # the agent's job is the longest: started first, the baselines share the other worker(s) meanwhile
        order = sorted(trained, key=lambda m: prof.sft_for(m).get("mode") != "agent")
        jobs = train_methods(stack, order, prof, str(base), world, threads=threads)
        timings["train_all_s"] = time.monotonic() - t3
        for method in trained:
            timings[f"train_{method}_s"] = jobs[method]["train_s"]
        t4 = time.monotonic()
        methods = evaluate_methods({m: str(registry("model", world).resolve(jobs[prof.model_of(m)]["model"]))
                                    for m in prof.methods}, world, stack, eval_qs, run_dir, port_offset + 100, timings)
        timings["eval_all_s"] = time.monotonic() - t4
        console.print(format_table(methods, prof.eval_split))
        prm = None
        if prof.stage2 is not None and "sft" in jobs:
            prm = stage2(prof, stack, world, str(registry("model", world).resolve(jobs["sft"]["model"])), run_dir,
                         port_offset + 100, timings)
        stage34_out, comparisons, deep, deep_scores = None, {}, [], {}
        if prof.stage34 is not None and "sft" in jobs:
            deep = []
            if prof.deep_questions:
                from prorag.data.world import DEEP_SPLITS, ensure_deep_split

                # a dev run gets its own deep split, drawn after the test one and disjoint from it
                ensure_deep_split(paths.world_dir(world), prof.deep_questions, prof.eval_split)
                deep = load_split(paths.world_dir(world), DEEP_SPLITS[prof.eval_split])
            stage34_out, later, deep_scores = stage34(prof, stack, world, jobs["sft"]["model"], prm, eval_qs,
                                                      run_dir, port_offset, timings, deep=deep)
            methods.update(later)
            comparisons = compare(run_dir, methods, [*eval_qs, *deep])
    t5 = time.monotonic()
    probes = copy_probes({"base": str(base), **{m: str(registry("model", world).resolve(jobs[m]["model"]))
                                                 for m in methods if m in jobs}}, test)
    diag = diagnostics(methods, probes)
    timings["diagnostics_s"] = time.monotonic() - t5
    print_diagnostics(diag)
    if stage34_out is not None:
        from prorag_app.stage34 import print_comparisons, print_rl

        console.print(format_table(methods, prof.eval_split))
        print_rl(stage34_out["rl"])
        print_comparisons(comparisons, prof.eval_split)
        for m, why in stage34_out["skipped"].items():
            console.print(f"[yellow]{m}: skipped: {why}[/yellow]")
    figure = multi_hop_figure(methods)
    if figure:
        console.print(f"{figure['group']}: sft - standard_rag = {100 * figure['margin']:+.1f} F1; CI widths "
                      f"{100 * figure['better_ci_width']:.1f} / {100 * figure['baseline_ci_width']:.1f}; "
                      f"figure {'reached' if figure['reached'] else 'NOT reached'}")
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
        "total_s": time.monotonic() - t0,
    }
    path = write_results(run_dir, results)
    console.print(f"results: {path} (runs/latest/results.json)")
    from prorag_app.report import build_report

    # the run's report beside its results: runs/latest/report/index.html opens from disk in a browser
    console.print(f"html report: {build_report([run_dir], run_dir / 'report')['html']}")
    console.print(json.dumps({k: round(v, 1) for k, v in timings.items()}))
    return results


# ---------------------------------------------------------------- the ablation report
@dataclass(frozen=True)
class AblationPlan:
    """What a multi-run plan runs on top of a profile: `prorag run --profile ablation` (issue 19's report: the headline
    comparison over several stage 3-4 seeds, the first with ProRAG without RFT and the RL adapters of earlier
    iterations evaluated too, and ProRAG at other betas) or `--profile research` (issue 30's experiment over three
    seeds); then `prorag report` over all of them."""

    profile: str = "default"
    name: str = "ablation"  # the runs' names: <name>/seed<k>, <name>/beta<b>
    seeds: tuple[int, ...] = (1, 2, 3)  # stage 3-4 seeds; 1 is the profile's own, so `make run`'s jobs are reused
    betas: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9)  # besides the profile's 0.3, at the first seed
    eval_iterations: tuple[int, ...] = (3, 5)  # RL adapters evaluated after these iterations (3 of 10: a third)


ABLATION = AblationPlan()
#: issue 30's table: the research profile over three seeds (its own eval_iterations), no beta sweep
RESEARCH = AblationPlan(profile="research", name="research", betas=(), eval_iterations=())
PLANS = {"ablation": ABLATION, "research": RESEARCH}


def run_ablation(plan: AblationPlan = ABLATION, world: str | None = None, port_offset: int = 0, split: str = "test",
                 overrides: tuple[str, ...] = ()) -> dict:
    """Every run of ``plan`` on ``split`` with ``overrides`` (`--set`) applied (each run reusing what earlier runs
    trained: the SFT agent, stage 2, RFT, the pool), then one report over them in a new run directory; returns the
    report (prorag_app.report.build_report)."""
    from prorag.runs import new_run_dir, point_latest
    from prorag_app.report import build_report

    base = with_overrides(dataclasses.replace(PROFILES[plan.profile], eval_split=split), overrides)
    if base.stage34 is None:
        raise InvalidArgument(f"profile {plan.profile!r} has no stages 3-4 to ablate")
    run_dirs = []
    for k, seed in enumerate(plan.seeds):
        prof = with_stage34(base, seed)
        if k == 0:
            methods = tuple(dict.fromkeys((*prof.stage34.get("methods", ("rft", "prorag", "outcome_grpo",
                                                                        "reasonrag")), "prorag_no_rft")))
            extra = {"eval_iterations": tuple(plan.eval_iterations)} if plan.eval_iterations else {}
            prof = dataclasses.replace(prof, stage34={**prof.stage34, "methods": methods, **extra})
        run_dirs.append(run_main_job(f"{plan.name}/seed{seed}", world, port_offset, prof=prof)["run_dir"])
    for beta in plan.betas:
        prof = with_stage34(base, plan.seeds[0] if plan.seeds else None, beta)
        prof = dataclasses.replace(prof, stage34={**prof.stage34, "methods": ("prorag",)})
        run_dirs.append(run_main_job(f"{plan.name}/beta{beta}", world, port_offset, prof=prof)["run_dir"])
    out = new_run_dir(f"{plan.name}-report")
    report = build_report(run_dirs, out)
    point_latest(out)
    console.print((out / "report.md").read_text())
    console.print(f"report: {out / 'report.md'}")
    if report.get("html"):
        console.print(f"html report: {report['html']}")
    return report
