"""`prorag diagnose rl RUN`: does a run's RL sharpen, memorise or drift (prorag.diagnosis, issue 47)? And
`prorag diagnose errors RUN`: why its models' answers are wrong, read from the trajectories it recorded.

The SFT agent and every RL adapter of the run (the final one and those after ``iterations``) answer two question
sets through the services: pool questions RL trained on (the run's question pool) and unseen deep questions of
the dev side. Each model answers greedily and with ``samples`` samples at temperature 1, one seed for all; the
report gives greedy and sampled F1, the sampled tokens' entropy, paired intervals against the SFT agent, wins and
losses by the SFT agent's solve rate, and the reading. Dev questions only: a diagnosis chooses what to fix.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from rich.table import Table

from prorag import paths
from prorag.algorithms.rl import ANSWER_CREDIT_F1
from prorag.data.loaders import load_split
from prorag.data.world import DEV_DEEP_SPLIT, ensure_deep_split
from prorag.diagnosis import (ANSWER_ERRORS, answer_error, error_transitions, gold_chain, reading, solve_rate_bin,
                              token_entropy, wins_losses_by_bin)
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.evaluation import COMPARISON_MIN_HOPS, paired_difference
from prorag.io import write_json
from prorag.metrics import f1_score
from prorag.rpc.clients import PolicyClient, push_adapter
from prorag_app.pipeline import eval_options
from prorag_app.profiles import PROFILES, RECIPE
from prorag_app.report import error_counts, load_run, run_error_kinds
from prorag_app.run_tables import console, print_answer_errors
from prorag_app.stack import ServiceStack
from services.trainer.stage_rl import adapter_version, read_question_pool, select_questions

#: the RL methods that start from the SFT agent, so their adapters are served over it and read against it
#: (ProRAG proper starts from the RFT model: its reference would be RFT, which this does not serve)
RL_METHODS = ("outcome_grpo", "prorag_no_rft", "prorag_oracle")


def pool_of(run: dict) -> dict | None:
    """The run's question pool artifact (services.trainer.stage_rlpool's pool.json), or None when its RL drew from
    the whole split; FailedPrecondition when it had one that is gone."""
    path = ((run.get("stage34") or {}).get("pool") or {}).get("path")
    if not path:
        return None
    if not Path(path).is_file():
        raise FailedPrecondition(f"run {run.get('run_dir')}: its question pool {path} is gone")
    return json.loads(Path(path).read_text())


def question_sets(run: dict, n: int, seed: int = 0) -> dict[str, list]:
    """{"pool": up to n of the questions the run's RL drew from (its pool's that pool_max_solve_rate kept, or without
    a pool the RL's own selection of its split), "unseen": up to n dev deep questions}, each a seeded draw in the
    split's order."""
    world = run["world"]
    pool, rl = pool_of(run), ((run.get("stage34") or {}).get("settings") or {}).get("rl") or {}
    if pool is not None:
        # the learnable questions the RL kept (pool_max_solve_rate, pool_max_greedy_f1), not the whole pool: the
        # others it never drew
        wanted = set(read_question_pool(run["stage34"]["pool"]["path"], pool["world"], pool["split"],
                                        float(rl.get("pool_max_solve_rate", 1.0)),
                                        float(rl.get("pool_max_greedy_f1", 1.0))))
        pool_qs = [q for q in load_split(paths.world_dir(world), pool["split"]) if q.id in wanted]
    else:
        pool_qs = load_split(paths.world_dir(world), rl.get("split", "train"))
    pool_qs = select_questions(pool_qs, int(rl.get("min_hops", 0)), int(rl.get("max_questions", 0)))
    if not (paths.world_dir(world) / f"{DEV_DEEP_SPLIT}.jsonl").exists():
        # drawn only when missing: asking for another size would redraw the dev deep split (and the held-out one)
        # and the test deep split before it (when missing) at the size the run's profile reads it at
        prof = PROFILES.get(str(run.get("profile", "")), RECIPE)
        ensure_deep_split(paths.world_dir(world), max(n, 1), "dev", test_n=prof.deep_questions)
    unseen = load_split(paths.world_dir(world), DEV_DEEP_SPLIT)

    def draw(qs: list) -> list:
        picked = sorted(random.Random(seed).sample(range(len(qs)), min(n, len(qs))))
        return [qs[i] for i in picked]

    return {"pool": draw(pool_qs), "unseen": draw(unseen)}


def adapters_of(run: dict, iterations: tuple[int, ...]) -> dict[str, str]:
    """{model name: adapter name@version}: "sft" (no adapter), each RL method's final adapter, and the ones it
    published after ``iterations`` (as <method>@it<i>)."""
    s34 = run.get("stage34") or {}
    out = {"sft": ""}
    for m in RL_METHODS:
        if m not in (s34.get("jobs") or {}):
            continue
        final = int((s34.get("rl") or {}).get(m, {}).get("iterations", 0))
        for i in iterations:
            if 0 < i < final:
                out[f"{m}@it{i}"] = f"{m}@{adapter_version(s34['jobs'][m], i)}"
        out[m] = s34["models"][m]["adapter"]
    return out


def answer(policy, questions, adapter: str, n: int, temperature: float, seed: int, topk: int, max_steps: int
           ) -> dict[str, dict]:
    """question id -> {"f1": [n], "logprobs": [n][generated tokens], "adapters": {adapter version that answered},
    "errors": [n] prorag.diagnosis.ANSWER_ERRORS entries (empty for a question without a gold chain)} of ``n``
    rollouts per question."""
    by_id = {q.id: q for q in questions}
    chains = {q.id: gold_chain(q.metadata or {}) for q in questions}
    out = {q.id: {"f1": [], "logprobs": [], "adapters": set(), "errors": []} for q in questions}
    sampling = policy.sampling(n=n, temperature=temperature, seed=seed)
    for t in policy.rollout([(q.id, q.question) for q in questions], sampling, max_steps=max_steps, topk=topk,
                            adapter=adapter):
        if not hasattr(t, "question_id"):
            continue  # the summary
        f1 = f1_score(t.answer, by_id[t.question_id].golden_answers) if t.finish_reason == "answer" else 0.0
        row = out[t.question_id]
        row["f1"].append(f1)
        row["logprobs"].append([lp for lp, g in zip(t.trace.logprobs, t.trace.generated_mask) if g])
        row["adapters"].add(t.adapter_version)
        if chains[t.question_id]:
            steps = MessageToDict(t, preserving_proto_field_name=True).get("steps", [])
            row["errors"].append(answer_error(steps, t.finish_reason, chains[t.question_id], f1))
    return out


def summarise(greedy: dict, sampled: dict) -> dict:
    """One model on one question set: its greedy F1 and answer error per question, mean sampled F1, right-sample
    rate, entropy."""
    return {"greedy": {q: r["f1"][0] for q, r in greedy.items() if r["f1"]},
            "errors": {q: r["errors"][0] for q, r in greedy.items() if r["errors"]},
            "sampled_f1": _mean([f for r in sampled.values() for f in r["f1"]]),
            "solve_rate": {q: sum(f >= ANSWER_CREDIT_F1 for f in r["f1"]) / len(r["f1"])
                           for q, r in sampled.items() if r["f1"]},
            "entropy": token_entropy([lp for r in sampled.values() for lp in r["logprobs"]]),
            # which adapter answered, as every trajectory reports it: a diagnosis of the adapter, not of another
            "adapters": sorted({a for part in (greedy, sampled) for r in part.values() for a in r["adapters"]})}


def diagnose(run: dict, models: dict[str, str], sets: dict[str, list], answers: dict) -> dict:
    """The report from ``answers`` [model][set] = summarise(...): per model and set the greedy and sampled F1,
    entropy, the greedy answers' errors, the paired interval against SFT, wins/losses by the SFT agent's solve-rate
    bin and which errors it fixed or made against SFT; per model the reading. Solve rates: the pool's own for pool
    questions where it recorded them, else the SFT agent's samples."""
    rates = (pool_of(run) or {}).get("questions", {})
    sft = answers["sft"]
    bins = {s: {q: solve_rate_bin(rates[q]["solve_rate"] if s == "pool" and "solve_rate" in rates.get(q, {}) else r)
                for q, r in sft[s]["solve_rate"].items()} for s in sets}
    out = {"models": {}}
    for name in models:
        row = {}
        for s in sets:
            mine, ref = answers[name][s], sft[s]
            ids = sorted(set(mine["greedy"]) & set(ref["greedy"]))
            diff = paired_difference([[mine["greedy"][q] for q in ids]], [[ref["greedy"][q] for q in ids]]) \
                if ids and name != "sft" else None
            row[s] = {"n": len(ids), "adapters": mine["adapters"], "greedy_f1": _mean(list(mine["greedy"].values())),
                      "sampled_f1": mine["sampled_f1"], "entropy": mine["entropy"],
                      "errors": {e: sum(v == e for v in mine["errors"].values()) for e in ANSWER_ERRORS},
                      **({"error_transitions": error_transitions(ref["errors"], mine["errors"])}
                         if name != "sft" else {}),
                      **({"greedy_diff": diff["f1_diff"], "greedy_ci": list(diff["ci"]),
                          "by_solve_rate": wins_losses_by_bin(mine["greedy"], ref["greedy"], bins[s])}
                         if diff else {})}
        if name != "sft":
            gain = _mean([row[s]["sampled_f1"] - sft[s]["sampled_f1"] for s in sets])
            d_entropy = _mean([row[s]["entropy"] - sft[s]["entropy"] for s in sets])
            row["reading"] = reading(row["pool"].get("greedy_ci"), row["unseen"].get("greedy_ci"), gain, d_entropy)
        out["models"][name] = row
    return out


def run_diagnosis(run_dir: str | Path, questions: int = 300, samples: int = 4, iterations: tuple[int, ...] = (),
                  port_offset: int = 0, seed: int = 0) -> dict:
    """Diagnose the RL of the `prorag run` in ``run_dir``; writes diagnosis.json there and returns it."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise InvalidArgument(f"{run_dir} has no results.json: not the directory of a finished `prorag run`")
    if questions < 1 or samples < 2:
        raise InvalidArgument(f"--questions is at least 1 and --samples at least 2; got {questions}, {samples}")
    run = json.loads(path.read_text())
    if run.get("split") == "test":
        console.print("[yellow]this run evaluated the test split; the diagnosis itself reads the pool (train) "
                      "and the dev deep split only[/yellow]")
    models = adapters_of(run, iterations)
    if len(models) == 1:
        raise FailedPrecondition(f"run {run_dir} trained no RL method ({', '.join(RL_METHODS)}): nothing to diagnose")
    sft_dir = run["stage34"]["models"][next(m for m in RL_METHODS if m in run["stage34"]["jobs"])]["model"]
    sets = question_sets(run, questions, seed)
    kw = eval_options("sft", sft_dir)
    topk, max_steps = int(kw["topk"]), int(kw.get("max_steps", 0))
    answers: dict = {}
    stack = ServiceStack(port_offset=port_offset, world=run["world"], services=("retriever", "policy"),
                         overrides={"policy": {"model": sft_dir, "restore_active": False}},
                         log_dir=str(Path(run_dir) / "logs" / "diagnose"))
    with stack, PolicyClient(stack.grpc_target("policy"), timeout=3600) as policy:
        for name, adapter in models.items():
            if adapter:
                a_name, _, version = adapter.partition("@")
                acks = push_adapter([stack.grpc_target("policy")], a_name, version)
                if not all(a.ok for a in acks):
                    raise FailedPrecondition(f"the policy did not load {adapter}: " + "; ".join(a.error for a in acks))
            answers[name] = {
                s: summarise(answer(policy, qs, adapter, 1, 0.0, seed, topk, max_steps),
                             answer(policy, qs, adapter, samples, 1.0, seed + 1, topk, max_steps))
                for s, qs in sets.items()}
            console.print(f"diagnose: {name} answered")
    report = {"run": str(run_dir), "questions": {s: len(qs) for s, qs in sets.items()}, "samples": samples,
              "adapters": models,
              **diagnose(run, models, sets, answers)}
    write_json(Path(run_dir) / "diagnosis.json", report)
    print_diagnosis(report)
    return report


def print_diagnosis(report: dict) -> None:
    table = Table(title="RL diagnosis: greedy and sampled F1 (x100), entropy (nats/token), greedy - SFT [95% CI]")
    for col in ("model", "set", "n", "greedy", "sampled", "entropy", "greedy - SFT", "wins/losses by SFT solve rate",
                "reading"):
        table.add_column(col)
    for name, row in report["models"].items():
        for s in ("pool", "unseen"):
            r = row[s]
            ci = (f"{100 * r['greedy_diff']:+.1f} [{100 * r['greedy_ci'][0]:+.1f}, {100 * r['greedy_ci'][1]:+.1f}]"
                  if "greedy_ci" in r else "-")
            bins = " ".join(f"{b} {v['wins']}/{v['losses']}" for b, v in r.get("by_solve_rate", {}).items() if v["n"])
            table.add_row(name, s, str(r["n"]), f"{100 * r['greedy_f1']:.1f}", f"{100 * r['sampled_f1']:.1f}",
                          f"{r['entropy']:.3f}", ci, bins or "-", row.get("reading", "") if s == "pool" else "")
    console.print(table)
    for name, row in report["models"].items():
        for s in ("pool", "unseen"):
            if "error_transitions" in row[s]:
                console.print(f"{name} on {s} questions against sft: {_fixed_made(row[s]['error_transitions'])}")


def _fixed_made(transitions: dict) -> str:
    """'fixed N (kind n, ...); made M (kind m, ...)' of an error_transitions table: SFT's errors the model answers
    right, and SFT's right answers the model gets wrong, by kind."""
    fixed = {e: transitions[e]["right"] for e in ANSWER_ERRORS if e != "right" and transitions[e]["right"]}
    made = {e: transitions["right"][e] for e in ANSWER_ERRORS if e != "right" and transitions["right"][e]}
    return (f"fixed {sum(fixed.values())} ({', '.join(f'{e} {n}' for e, n in fixed.items()) or '-'}); "
            f"made {sum(made.values())} ({', '.join(f'{e} {n}' for e, n in made.items()) or '-'})")


def error_diagnosis(run_dir: str | Path, min_hops: int = COMPARISON_MIN_HOPS, reference: str = "sft") -> dict:
    """Why each evaluated model's answers are wrong (prorag.diagnosis.ANSWER_ERRORS), on the run's split and deep
    questions of at least ``min_hops`` hops (never its held-out ones: they are read once, for the claim), and
    which errors each model fixed or made against ``reference``. No model runs; writes RUN/errors.json."""
    if min_hops < 1:
        raise InvalidArgument(f"--min-hops is at least 1; got {min_hops}")
    run = load_run(run_dir)
    if run["results"].get("split") == "test":
        console.print("[yellow]this run evaluated the test split: read its errors to understand, not to choose "
                      "settings (choices are made on dev)[/yellow]")
    records, kinds = run_error_kinds(run, min_hops)
    if not records:
        raise FailedPrecondition(f"run {run_dir} recorded no trajectory of a question of {min_hops}+ hops")
    if not any(kinds.values()):
        raise FailedPrecondition(f"the questions of run {run_dir} carry no gold chain (metadata.decomposition with "
                                 "a doc_id per hop, as the embedded world writes), so their errors cannot be read "
                                 "along it")
    every = {q for recs in records.values() for q in recs}
    chained = {q for k in kinds.values() for q in k}
    report = {"run": str(run_dir), "min_hops": min_hops, "reference": reference,
              "questions_without_chain": len(every - chained),
              "methods": error_counts(kinds),
              "transitions": {m: error_transitions(kinds[reference], k) for m, k in kinds.items()
                              if reference in kinds and m != reference}}
    write_json(Path(run_dir) / "errors.json", report)
    print_errors(report)
    return report


def print_errors(report: dict) -> None:
    print_answer_errors(report["methods"], report["min_hops"])
    for m, tr in report["transitions"].items():
        console.print(f"{m} against {report['reference']}: {_fixed_made(tr)}")


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0
