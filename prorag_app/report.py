"""`prorag report`: one report over several `prorag run` results on the same test questions (seeds, betas).

Each run directory holds results.json and every evaluated method's predictions.jsonl. A method's runs are its
seeds: per question, EM and F1 are averaged over the runs that evaluated it, then the questions are resampled
for the CIs (prorag.evaluation), so the intervals reflect which questions were asked and the seeds only reduce
per-question noise. Comparisons are paired per question over the pooled seeds (compare_methods), on the test split
and the world's deep split (3+ hop questions) where the runs evaluated it. Runs whose
stages 3-4 used different betas also give ProRAG's F1 against beta; the RL jobs' iteration journals give the
training rollouts' F1 against the number of RL questions seen (on train questions), and RL adapters evaluated
after some of their iterations give the test F1 against RL questions seen (data efficiency).

Written to the output directory: report.md, report.json and PNG plots (per hop count, RL curves, data efficiency, beta);
and an HTML page (prorag_app.report_html) to the first run's report/index.html unless told where.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from prorag import paths
from prorag.data.loaders import load_split
from prorag.diagnosis import ANSWER_ERRORS, answer_error, gold_chain
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.evaluation import COMPARISON_MIN_HOPS, compare_methods, score_records
from prorag.io import write_json
from prorag.methods import COMPARISONS, base_method
from prorag_app.report_html import write_html
from prorag_app.report_parts import HOP_GROUPS, pct, svg_of


def _predictions(root: Path, methods) -> dict[str, dict[str, dict]]:
    out = {}
    for method in methods:
        preds = root / method / "predictions.jsonl"
        if preds.is_file():
            out[method] = {r["id"]: r for r in map(json.loads, preds.read_text().splitlines()) if r}
    return out


def load_run(run_dir: str | Path) -> dict:
    """{"dir", "results", "records": {method: {question id: record}}, "deep": the same on the world's deep split}
    of one `prorag run` directory."""
    run_dir = Path(run_dir)
    path = run_dir / "results.json"
    if not path.is_file():
        raise InvalidArgument(f"{run_dir} has no results.json: not the directory of a finished `prorag run`")
    results = json.loads(path.read_text())
    return {"dir": str(run_dir), "results": results, "records": _predictions(run_dir, results.get("methods", {})),
            "deep": _predictions(run_dir / "deep", results.get("methods", {})),
            "heldout": _predictions(run_dir / "heldout", results.get("methods", {}))}


def gold_chains(world_dir: Path, records: dict[str, dict]) -> dict[str, list]:
    """Question id -> its gold chain (prorag.diagnosis.gold_chain) for the records' questions whose world question
    carries one, read from the split its id names ("dev_deep_3" -> dev_deep.jsonl).
    FailedPrecondition when a record's question text is not the world's under that id (a split redrawn since)."""
    splits: dict[str, dict] = {}
    out = {}
    for qid, rec in records.items():
        split = qid.rsplit("_", 1)[0]
        if split not in splits:
            try:
                splits[split] = {q.id: q for q in load_split(world_dir, split)}
            except FileNotFoundError:
                splits[split] = {}
        q = splits[split].get(qid)
        if q is None:
            continue
        if rec.get("question") not in (None, q.question):
            raise FailedPrecondition(f"question {qid} of the run reads {rec['question']!r}, the world's "
                                     f"{q.question!r}: its split was redrawn since the run, so its chains do not "
                                     "apply")
        chain = gold_chain(q.metadata or {})
        if chain:
            out[qid] = chain
    return out


def run_error_kinds(run: dict, min_hops: int = COMPARISON_MIN_HOPS) -> tuple[dict, dict]:
    """(records, kinds) of one load_run: records {method: {question id: record}} of the split and deep questions of
    ``min_hops``+ hops with a recorded trajectory (never the held-out ones), and kinds {method: {question id:
    prorag.diagnosis.ANSWER_ERRORS entry}} of those whose question carries a gold chain."""
    records: dict[str, dict[str, dict]] = {}
    for part in ("records", "deep"):
        for method, recs in run[part].items():
            records.setdefault(method, {}).update(
                {q: r for q, r in recs.items() if int(r.get("hops", 0)) >= min_hops and r.get("trajectory")})
    records = {m: recs for m, recs in records.items() if recs}
    chains = gold_chains(paths.world_dir(run["results"]["world"]),
                         {q: r for recs in records.values() for q, r in recs.items()})
    kinds = {m: {q: answer_error(r["trajectory"].get("steps") or [], r.get("finish_reason", ""), chains[q],
                                 float(r.get("f1", 0.0)))
                 for q, r in recs.items() if q in chains} for m, recs in records.items()}
    return records, kinds


def error_counts(kinds: dict[str, dict[str, str]], into: dict | None = None) -> dict:
    """{method: {question id: ANSWER_ERRORS entry}} -> {method: {"n", "counts": {entry: answers}}}, added to
    ``into``'s counts when given (runs summed as seeds); methods without a question are left out."""
    out = {} if into is None else into
    for m, k in kinds.items():
        if not k:
            continue
        row = out.setdefault(m, {"n": 0, "counts": {e: 0 for e in ANSWER_ERRORS}})
        row["n"] += len(k)
        for kind in k.values():
            row["counts"][kind] += 1
    return out


def error_shares(runs: list[dict]) -> dict:
    """Why each method's answers are wrong on the comparisons' questions (3+ hops, split and deep), summed over the
    runs: error_counts' {method: {"n", "counts"}}; empty when the questions carry no gold chain or a split was
    redrawn since a run (its records then name other questions than the world's)."""
    out: dict[str, dict] = {}
    for r in runs:
        try:
            error_counts(run_error_kinds(r)[1], into=out)
        except FailedPrecondition:
            return {}
    return out


def answer_errors_of(run_dir: str | Path, world: str, methods) -> dict:
    """error_shares of one run directory before its results.json is written (the pipeline's diagnostics)."""
    run_dir = Path(run_dir)
    return error_shares([{"dir": str(run_dir), "results": {"world": world},
                          "records": _predictions(run_dir, methods), "deep": _predictions(run_dir / "deep", methods)}])


def check_same_questions(runs: list[dict], parts: tuple[str, ...] = ("records", "deep", "heldout")) -> None:
    """InvalidArgument unless every question id the runs share names the same question in all of them. A world's
    drawn splits (deep, held-out, RL) are redrawn under the same ids when a split drawn before them changes size
    (prorag.data.world.ensure_drawn_split), so runs from either side of a redraw would otherwise be paired on
    different questions. Records without their question text (older runs) are not checked."""
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    clashes = []
    for run in runs:
        for part in parts:
            for recs in run[part].values():
                for q, rec in recs.items():
                    text = rec.get("question")
                    if text is None:
                        continue
                    first = seen.setdefault((part, q), (text, run["dir"]))
                    if first[0] != text:
                        clashes.append((q, first, (text, run["dir"])))
    if clashes:
        q, (a_text, a_dir), (b_text, b_dir) = clashes[0]
        raise InvalidArgument(f"the runs read different questions under the same ids ({len(clashes)} answers, e.g. "
                              f"{q}: {a_text!r} in {a_dir}, {b_text!r} in {b_dir}): the world's drawn splits were "
                              "redrawn between them, so they cannot be paired; compare runs made on one draw")


def cross_run_difference(a_dirs, b_dirs, method_a: str, method_b: str,
                         min_hops: int = COMPARISON_MIN_HOPS) -> dict:
    """Method A of the runs ``a_dirs`` minus method B of the runs ``b_dirs``, paired per question: what a choice made
    on dev reads (one setting's runs against another's, or a method against SFT across runs). The i-th run of each
    list is seed i of its side; the questions are those of at least ``min_hops`` hops that every run answered, its
    split and its deep split, as `prorag run`'s comparisons read them. Returns prorag.evaluation.paired_difference's
    figures with "a", "b" (method names), "runs_a", "runs_b" and "group"."""
    a_dirs, b_dirs = [str(d) for d in a_dirs], [str(d) for d in b_dirs]
    if not a_dirs or len(a_dirs) != len(b_dirs):
        raise InvalidArgument(f"{len(a_dirs)} run(s) against {len(b_dirs)}: give as many on each side, at least one "
                              "(the i-th of each is paired as seed i)")
    loaded = {d: load_run(d) for d in dict.fromkeys(a_dirs + b_dirs)}
    check_same_questions(list(loaded.values()))
    hops: dict[str, int] = {}

    def per_run(d: str, method: str) -> dict[str, float]:
        run = loaded[d]
        if method not in run["records"]:
            raise InvalidArgument(f"{d} has no predictions of {method!r} (it has {sorted(run['records'])})")
        out = {}
        for part in ("records", "deep"):
            for q, rec in run[part].get(method, {}).items():
                hops[f"{part}/{q}"] = int(rec["hops"])
                out[f"{part}/{q}"] = float(rec["f1"])
        return out

    per_question = {"a": [per_run(d, method_a) for d in a_dirs], "b": [per_run(d, method_b) for d in b_dirs]}
    result = compare_methods(per_question, hops, [("a", "b")], min_hops=min_hops).get("a_vs_b")
    if result is None:
        raise InvalidArgument(f"no question of {min_hops}+ hops that every run answered with its method")
    return {**result, "a": method_a, "b": method_b, "runs_a": a_dirs, "runs_b": b_dirs}


def seed_averaged(runs: list[dict], method: str) -> list[dict]:
    """One record per question every run of ``method`` answered: EM/F1/acc averaged over those runs."""
    per_run = [r["records"][method] for r in runs if method in r["records"]]
    if not per_run:
        return []
    ids = sorted(set.intersection(*(set(p) for p in per_run)))
    out = []
    for q in ids:
        rows = [p[q] for p in per_run]
        avg = {k: sum(float(r.get(k, 0.0)) for r in rows) / len(rows) for k in ("em", "f1", "acc")}
        out.append({"id": q, "hops": rows[0]["hops"], "type": rows[0]["type"], **avg})
    return out


def rl_curve(job_id: str) -> list[dict]:
    """[{"questions" (cumulative RL questions), "f1" (the iteration's rollout F1), "reward"}] of one RL job."""
    path = paths.runs_dir() / "jobs" / job_id / "run" / "iterations.jsonl"
    if not path.is_file():
        return []
    rows, seen = [], 0
    for row in map(json.loads, path.read_text().splitlines()):
        seen += int(row.get("questions", 0))
        rows.append({"questions": seen, "f1": float(row.get("f1_mean", 0.0)),
                     "reward": float(row.get("reward_mean", 0.0))})
    return rows


def _rl_seed(run: dict):
    return (((run["results"].get("stage34") or {}).get("settings") or {}).get("rl") or {}).get("seed")


def data_efficiency(runs: list[dict]) -> dict:
    """F1 on the 3+ hop questions of each RL method's adapter after i of its iterations (evaluated as
    ``<method>@it<i>``) and at the end, against the RL questions it had seen, from the runs that evaluated such
    adapters; and the fewest questions at which ProRAG reaches outcome-only GRPO's final F1 in the same run
    (None: not within its budget). The issue's figure: at most a third of outcome GRPO's questions.

    Each curve starts at 0 questions with the model its RL began from (RL_STARTS: outcome GRPO and ProRAG without
    RFT from SFT, ProRAG from RFT). A run's points count the test split's questions and, where that run evaluated
    every point of the curves on the deep split too, the deep split's (one question set per run, so the points
    compare like for like). Returns {"runs": n, "questions": 3+ hop questions per point (the first run's),
    "curves": {method: [{"questions", "f1"}]} (averaged over those runs), "outcome_grpo_final_f1",
    "outcome_grpo_start_f1", "prorag_reaches_at", "outcome_grpo_questions"}."""
    def deep_group(recs: dict) -> list[float]:
        return [rec["f1"] for rec in recs.values() if int(rec["hops"]) >= COMPARISON_MIN_HOPS]

    points = defaultdict(lambda: defaultdict(list))  # method -> questions seen -> [F1 per run]
    used, n_questions = 0, None
    for r in runs:
        if not any("@it" in m for m in r["records"]):
            continue
        used += 1
        rl = ((r["results"].get("stage34") or {}).get("settings") or {}).get("rl") or {}
        per_iteration = int(rl.get("questions_per_iteration", 0))
        total = per_iteration * int(rl.get("iterations", 0))
        # (evaluated name, curve, RL questions seen) of every point this run gives
        run_points = []
        for m in r["records"]:
            base, _, it = m.partition("@it")
            if base in RL_STARTS and (not it or it.isdigit()):
                run_points.append((m, base, int(it) * per_iteration if it else total))
        for m, start in RL_STARTS.items():  # 0 questions: the model the RL began from
            if any(curve == m for _, curve, _ in run_points) and start in r["records"]:
                run_points.append((start, m, 0))
        with_deep = all(name in r["deep"] for name, _, _ in run_points)  # one question set for the whole run
        for name, curve, seen in run_points:
            group = deep_group({**r["records"][name], **(r["deep"][name] if with_deep else {})})
            if group:
                points[curve][seen].append(sum(group) / len(group))
                n_questions = len(group) if n_questions is None else n_questions
    curves = {m: [{"questions": q, "f1": sum(v) / len(v)} for q, v in sorted(pts.items())]
              for m, pts in points.items()}
    out = {"runs": used, "questions": n_questions, "curves": curves, "outcome_grpo_final_f1": None,
           "outcome_grpo_questions": None, "outcome_grpo_start_f1": None, "prorag_reaches_at": None}
    if curves.get("outcome_grpo") and curves.get("prorag"):
        final = curves["outcome_grpo"][-1]
        out["outcome_grpo_final_f1"], out["outcome_grpo_questions"] = final["f1"], final["questions"]
        start = curves["outcome_grpo"][0]
        out["outcome_grpo_start_f1"] = start["f1"] if start["questions"] == 0 else None
        out["prorag_reaches_at"] = next((p["questions"] for p in curves["prorag"]
                                         if p["questions"] > 0 and p["f1"] >= final["f1"]), None)
    return out


#: RL methods and the model each starts from (its curve's point at 0 questions)
RL_STARTS = {"outcome_grpo": "sft", "prorag_no_rft": "sft", "prorag_oracle": "sft", "prorag": "rft"}


#: methods whose model depends on ProRAG's beta (an evaluated name may carry "@it<i>")
BETA_METHODS = ("prorag", "prorag_no_rft", "prorag_oracle")


def name_by_beta(runs: list[dict]) -> None:
    """Rename, in place, the beta-dependent methods of runs whose beta is not the first run's (the headline's)
    to ``<method>[beta=<b>]``, so a beta sweep's runs are not pooled as seeds of the headline method."""
    def beta_of(r):
        return ((r["results"].get("stage34") or {}).get("settings") or {}).get("beta")

    headline = beta_of(runs[0])
    for r in runs:
        b = beta_of(r)
        r["names"] = {}
        if b is None or b == headline:
            continue
        r["names"] = {m: f"{m}[beta={b}]" for m in BETA_METHODS}
        for part in ("records", "deep"):
            r[part] = {(f"{m}[beta={b}]" if base_method(m) in BETA_METHODS else m): v for m, v in r[part].items()}


#: issue 30's chain, in order: each link is read from one comparison (A - B on 3+ hop questions) or from the PRM's
#: gate; the first link that does not hold is where the claim breaks
LINKS = (("RL learns", "outcome_grpo_vs_sft"),
         ("the oracle's step credit helps", "prorag_oracle_vs_outcome_grpo"),
         ("the PRM passes its gate", None),
         ("process supervision helps (the headline: same start)", "prorag_no_rft_vs_outcome_grpo"))


def claim_links(comparisons: dict, gates: list[dict]) -> dict:
    """Which link of the chain "RL learns -> step credit helps -> the PRM is good enough -> ProRAG beats outcome GRPO"
    holds, from pooled ``comparisons`` (compare_methods' output) and the PRM gate verdicts of the runs (``gates``).

    A comparison's link holds when its interval is above 0 (the seed-and-question interval where there is one, else
    the question one); "not shown" when the interval holds 0; "reversed" when it is below 0; "not run" without the
    comparison. The gate holds when every run's PRM passed it. Returns {"links": [{"link", "status", ...}],
    "first_failed": the first link not holding, or None}."""
    links = []
    for name, key in LINKS:
        if key is None:
            if not gates:
                links.append({"link": name, "status": "not run"})
            else:
                passed = all(g.get("passed") for g in gates)
                reasons = sorted({r for g in gates for r in g.get("reasons") or []})
                links.append({"link": name, "status": "holds" if passed else "fails", "runs": len(gates),
                              "reasons": reasons})
            continue
        c = comparisons.get(key)
        if not c:
            links.append({"link": name, "comparison": key, "status": "not run"})
            continue
        bounds = c.get("ci_seeds_questions") or c["ci"]
        status = "holds" if bounds[0] > 0 else ("reversed" if bounds[1] < 0 else "not shown")
        links.append({"link": name, "comparison": key, "status": status, "diff": c["f1_diff"], "ci": list(bounds),
                      "ci_includes_seeds": bool(c.get("ci_seeds_questions")), "seeds": c.get("seeds")})
    first = next((lk["link"] for lk in links if lk["status"] != "holds"), None)
    return {"links": links, "first_failed": first}


def build_report(run_dirs, out_dir: str | Path, html_dir: str | Path | None = None) -> dict:
    """Pool ``run_dirs`` (seeds) into one report under ``out_dir``, and its HTML page under ``html_dir`` (default:
    the first run's ``report/``, so `runs/latest/report/index.html` is the latest run's); returns what report.json
    holds (``html``: the page's path)."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise InvalidArgument("no runs to report on")
    check_same_questions(runs)
    betas = defaultdict(list)
    sweep_seed = _rl_seed(runs[0])
    for r in runs:  # ProRAG's 3+ hop F1 per beta, before the runs' methods are named by their beta
        beta = ((r["results"].get("stage34") or {}).get("settings") or {}).get("beta")
        if beta is not None and "prorag" in r["records"]:
            # the comparisons' questions: the test split's 3+ hop ones and the deep split where evaluated
            recs = {**r["records"]["prorag"], **r["deep"].get("prorag", {})}
            group = [rec["f1"] for rec in recs.values() if int(rec["hops"]) >= COMPARISON_MIN_HOPS]
            if group:
                betas[float(beta)].append((sum(group) / len(group), len(group), _rl_seed(r) == sweep_seed))
    efficiency = data_efficiency(runs)
    name_by_beta(runs)
    worlds = {r["results"].get("world") for r in runs}
    if len(worlds) != 1:
        raise InvalidArgument(f"the runs evaluate different worlds ({sorted(map(str, worlds))}): a report pools "
                              "seeds of the same test questions")
    methods = list(dict.fromkeys(m for r in runs for m in r["records"]))
    scores, seeds = {}, {}
    for m in methods:
        averaged = seed_averaged(runs, m)
        if averaged:
            scores[m] = score_records(averaged)
            seeds[m] = sum(m in r["records"] for r in runs)
    # the comparisons pool the test split with the deep split where a run evaluated it (question ids differ)
    hops = {q: int(rec["hops"]) for r in runs for part in ("records", "deep") for recs in r[part].values()
            for q, rec in recs.items()}
    per_question = {m: [{q: float(rec["f1"]) for q, rec in {**r["records"][m], **r["deep"].get(m, {})}.items()}
                        for r in runs if m in r["records"]] for m in methods}
    comparisons = compare_methods(per_question, hops, COMPARISONS)
    # issue 47's held-out split, compared on its own where every run evaluated it: the claim is then read there
    heldout = {}
    if all(r["heldout"] for r in runs):
        held_hops = {q: int(rec["hops"]) for r in runs for recs in r["heldout"].values() for q, rec in recs.items()}
        heldout = compare_methods({m: [{q: float(rec["f1"]) for q, rec in r["heldout"][m].items()}
                                       for r in runs if m in r["heldout"]]
                                   for m in methods if any(m in r["heldout"] for r in runs)}, held_hops, COMPARISONS)
    curves = defaultdict(list)
    for r in runs:
        s34 = r["results"].get("stage34") or {}
        for m, job_id in (s34.get("jobs") or {}).items():
            if m in ("prorag", "outcome_grpo", "prorag_no_rft", "prorag_oracle"):
                curve = rl_curve(job_id)
                if curve:
                    curves[r["names"].get(m, m)].append(curve)
    report = {"runs": [r["dir"] for r in runs], "world": worlds.pop(), "seeds": seeds,
              "methods": scores, "comparisons": comparisons, "errors": error_shares(runs),
              "rl_curves": dict(curves),
              "beta": {str(b): {"f1_3plus_mean": sum(f for f, _, _ in v) / len(v), "runs": len(v),
                                "questions": v[0][1],
                                # the sweep's own seed (the first run's), so that betas compare like for like
                                "f1_3plus_sweep_seed": next((f for f, _, same in v if same), None)}
                       for b, v in sorted(betas.items())},
              "data_efficiency": efficiency,
              "claim": {**claim_links(heldout or comparisons, [(r["results"].get("prm") or {})["gate"] for r in runs
                                                            if "gate" in (r["results"].get("prm") or {})]),
                        "read_on": "heldout" if heldout else "test"}}
    if heldout:
        report["comparisons_heldout"] = heldout
    report["budget"] = budget_note([r["results"].get("profile", "") for r in runs])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    svgs: dict[str, str] = {}
    pngs = write_plots(report, out_dir, svgs)
    report["plots"] = pngs
    report["html"] = str(write_html(report, runs, Path(html_dir) if html_dir else Path(runs[0]["dir"]) / "report",
                                    svgs))
    write_json(out_dir / "report.json", report)
    tmp = out_dir / "report.md.tmp"
    tmp.write_text(markdown(report))
    tmp.replace(out_dir / "report.md")
    return report


#: profiles whose stages 2-4 are demonstrations sized for `make run`'s hour on 2 cores, not measurements of the claim
DEMONSTRATION_PROFILES = ("default", "full", "tiny", "quick", "stage1")


def budget_note(profiles: list[str]) -> str:
    """What a report's stage 2-4 figures are: a demonstration at `make run`'s budget (the default profile, or seeds
    of the ablation over it), or the research profile's experiment; says so in one sentence for the reader."""
    names = {p.split("/")[0] for p in profiles}
    if names and names <= {"research"}:
        return ("The research profile's experiment: its figures are the project's measurement of the paper's claim "
                "(docs/BENCHMARKS.md records how its settings were chosen on dev).")
    if names & {*DEMONSTRATION_PROFILES, "ablation"}:
        return ("Stages 2-4 here are demonstrations at `make run`'s budget (an hour on 2 cores, so stage 2's "
                "search and RL's iterations are cut to minutes): they show each stage working, not whether process "
                "supervision helps; that is the research profile's figure (`prorag run --profile research`, "
                "docs/BENCHMARKS.md).")
    return "Runs of profiles " + ", ".join(sorted(n or "-" for n in names)) + "."


def comparison_table(comparisons: dict) -> list[str]:
    """The markdown lines of one table of paired comparisons (compare_methods' output)."""
    def ci(bounds) -> str:
        return f"[{100 * bounds[0]:+.1f}, {100 * bounds[1]:+.1f}]" if bounds else "- (one seed)"

    lines = ["95% CI over questions of the seed-averaged differences; and, with 2+ seeds, resampling seeds then "
             "questions, which puts training noise in the interval too.", "",
             "| A vs B | group | A | B | A - B | 95% CI, questions | 95% CI, seeds and questions | n | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in comparisons.items():
        lines.append(f"| {name} | {c['group']} | {pct(c['a_mean'])} | {pct(c['b_mean'])} | "
                     f"{100 * c['f1_diff']:+.1f} | {ci(c['ci'])} | {ci(c.get('ci_seeds_questions'))} | "
                     f"{c['n']} | {c['seeds']} |")
    return lines


def markdown(report: dict) -> str:
    lines = [f"# Report: {len(report['runs'])} run(s) on world `{report['world']}`", "",
             *([report["budget"], ""] if report.get("budget") else []),
             "F1 x100 [95% CI over questions of the seed-averaged F1]; seeds = runs that evaluated the method.", "",
             "| method | seeds | overall | " + " | ".join(f"{h}-hop" for h in HOP_GROUPS) + " | 2+ hops | EM |",
             "|---|---|---|" + "---|" * len(HOP_GROUPS) + "---|---|"]
    for m, s in report["methods"].items():
        def cell(stat):
            return f"{pct(stat['f1'])} [{pct(stat['f1_ci'][0])}, {pct(stat['f1_ci'][1])}]" if stat else "-"
        row = [m, str(report["seeds"][m]), cell(s["overall"]),
               *(cell(s["by_hops"].get(h)) for h in HOP_GROUPS), cell(s.get("multi_hop")), pct(s["overall"]["em"])]
        lines.append("| " + " | ".join(row) + " |")
    for key, title in (("comparisons", "Paired comparisons (A minus B per question, pooled seeds)"),
                       ("comparisons_heldout", "Paired comparisons on the held-out split, read once")):
        if report.get(key):
            lines += ["", f"## {title}", "", *comparison_table(report[key])]
    if report.get("errors"):
        lines += ["", "## Why answers are wrong (questions of 3+ hops, answers summed over seeds; % of them)", "",
                  "Read along each question's gold chain at the first hop the agent never resolved "
                  "(`prorag diagnose errors`, prorag.diagnosis.ANSWER_ERRORS).", "",
                  "| method | answers | " + " | ".join(ANSWER_ERRORS) + " |", "|---|---|" + "---|" * len(ANSWER_ERRORS)]
        for m, row in report["errors"].items():
            lines.append(f"| {m} | {row['n']} | "
                         + " | ".join(f"{100 * row['counts'][e] / row['n']:.1f}" for e in ANSWER_ERRORS) + " |")
    claim = report.get("claim")
    if claim:
        where = "the held-out split" if claim.get("read_on") == "heldout" else "the test and deep splits"
        lines += ["", "## Where the claim stands, link by link", "", f"Read on {where}.", "",
                  "| link | comparison | A - B | 95% CI | status |", "|---|---|---|---|---|"]
        for lk in claim["links"]:
            diff = f"{100 * lk['diff']:+.1f}" if "diff" in lk else "-"
            if "ci" in lk:
                bounds = (f"[{100 * lk['ci'][0]:+.1f}, {100 * lk['ci'][1]:+.1f}]"
                          + (" (seeds and questions)" if lk.get("ci_includes_seeds") else " (questions)"))
            else:
                bounds = "; ".join(lk.get("reasons") or []) or "-"
            lines.append(f"| {lk['link']} | {lk.get('comparison', 'PRM gate')} | {diff} | {bounds} | {lk['status']} |")
        lines += ["", f"First link that does not hold: **{claim['first_failed']}**." if claim["first_failed"]
                  else "Every link holds."]
    if report["beta"]:
        lines += ["", "## ProRAG's F1 on 3+ hop questions against beta", "",
                  "Test split and deep split together; the sweep's seed is the first run's (the other betas run at "
                  "it only).", "",
                  "| beta | F1, sweep's seed | F1, mean over runs | runs | questions |", "|---|---|---|---|---|"]
        lines += [f"| {b} | {pct(v['f1_3plus_sweep_seed']) if v.get('f1_3plus_sweep_seed') is not None else '-'} | "
                  f"{pct(v['f1_3plus_mean'])} | {v['runs']} | {v.get('questions', '-')} |"
                  for b, v in report["beta"].items()]
    eff = report.get("data_efficiency") or {}
    if eff.get("curves"):
        seen = sorted({p["questions"] for pts in eff["curves"].values() for p in pts})
        lines += ["", "## Data efficiency: F1 on 3+ hop questions against RL questions seen", "",
                  f"RL adapters evaluated after some of their iterations, in {eff['runs']} run(s), on "
                  f"{eff.get('questions')} questions of 3+ hops; 0 questions is the model each RL began from "
                  "(SFT; RFT for ProRAG).", "",
                  "| method | " + " | ".join(f"{q} questions" for q in seen) + " |", "|---|" + "---|" * len(seen)]
        for m, pts in eff["curves"].items():
            at = {p["questions"]: p["f1"] for p in pts}
            lines.append(f"| {m} | " + " | ".join(pct(at[q]) if q in at else "-" for q in seen) + " |")
        if eff.get("outcome_grpo_final_f1") is not None:
            at = eff.get("prorag_reaches_at")
            lines += ["", f"Outcome-only GRPO's final F1 ({pct(eff['outcome_grpo_final_f1'])}, after "
                          f"{eff['outcome_grpo_questions']} questions): ProRAG reaches it "
                          + (f"after {at} questions ({at / eff['outcome_grpo_questions']:.2f} of them)." if at
                             else "at none of its evaluated points.")]
            start = eff.get("outcome_grpo_start_f1")
            if start is not None and eff["outcome_grpo_final_f1"] <= start:
                # reaching a final that RL did not raise says nothing about data efficiency: say so
                lines.append(f"Outcome-only GRPO ended at or below the model it started from ({pct(start)} at 0 "
                             "questions), so reaching its final F1 shows no learning.")
    if report["rl_curves"]:
        lines += ["", "## RL: rollout F1 against RL questions seen (train questions; data efficiency)", ""]
        for m, curves in report["rl_curves"].items():
            for i, c in enumerate(curves):
                lines.append(f"- {m} (run {i + 1}): " + ", ".join(f"{p['questions']}: {pct(p['f1'])}" for p in c))
    for name, path in report.get("plots", {}).items():
        lines += ["", f"![{name}]({Path(path).name})"]
    return "\n".join(lines) + "\n"


def write_plots(report: dict, out_dir: Path, svgs: dict[str, str] | None = None) -> dict[str, str]:
    """The PNGs (name -> path); ``svgs``, when given, also gets each plot as an inline SVG element (the HTML
    report's copy of the same figure)."""
    import matplotlib  # heavy; only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}

    def save(fig, name: str) -> None:
        tmp = out_dir / f"{name}.tmp.png"
        fig.tight_layout()
        fig.savefig(tmp, dpi=100)
        if svgs is not None:
            svgs[name] = svg_of(fig)
        plt.close(fig)
        tmp.replace(out_dir / f"{name}.png")
        out[name] = str(out_dir / f"{name}.png")

    methods = list(report["methods"])
    if methods:
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(HOP_GROUPS), 3.6))
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            stats = [report["methods"][m]["by_hops"].get(h) for h in HOP_GROUPS]
            xs = [j + i * width for j in range(len(HOP_GROUPS))]
            ys = [100 * s["f1"] if s else 0.0 for s in stats]
            err = [[100 * (s["f1"] - s["f1_ci"][0]) if s else 0 for s in stats],
                   [100 * (s["f1_ci"][1] - s["f1"]) if s else 0 for s in stats]]
            ax.bar(xs, ys, width, yerr=err, label=m, capsize=2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(HOP_GROUPS))], [f"{h}-hop" for h in HOP_GROUPS])
        ax.set_ylabel("F1 x100")
        ax.legend(fontsize=7)
        save(fig, "f1_by_hops")
    if report["rl_curves"]:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for k, (m, curves) in enumerate(report["rl_curves"].items()):
            for i, c in enumerate(curves):
                ax.plot([p["questions"] for p in c], [100 * p["f1"] for p in c], marker="o", markersize=3,
                        label=m if i == 0 else None, color=f"C{k % 10}", alpha=0.8)
        ax.set_xlabel("RL questions seen")
        ax.set_ylabel("rollout F1 x100 (train)")
        ax.legend(fontsize=8)
        save(fig, "rl_curves")
    eff = report.get("data_efficiency") or {}
    if eff.get("curves"):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for k, (m, pts) in enumerate(eff["curves"].items()):
            ax.plot([p["questions"] for p in pts], [100 * p["f1"] for p in pts], marker="o", label=m,
                    color=f"C{k % 10}")
        ax.set_xlabel("RL questions seen")
        ax.set_ylabel(f"F1 x100, {eff.get('questions')} questions of 3+ hops")
        ax.legend(fontsize=8)
        save(fig, "data_efficiency")
    if len(report["beta"]) > 1:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        bs = sorted(report["beta"], key=float)
        ax.plot([float(b) for b in bs], [100 * report["beta"][b]["f1_3plus_mean"] for b in bs], marker="o")
        ax.set_xlabel("beta")
        ax.set_ylabel("ProRAG F1 x100, 3+ hops")
        save(fig, "beta")
    return out


__all__ = ["build_report", "load_run", "markdown", "rl_curve", "seed_averaged", "write_plots"]
