"""The HTML report of `prorag report`: one folder holding index.html, which opens from disk with no server and no
network (nothing is fetched: plots are inline SVG, the viewers' data inline JSON, the script and styles inline).

Views: the method table and the paired comparisons with both CIs; the Markdown report's plots (F1 per hop count, the
beta sweep, data efficiency, the RL jobs' rollout F1); every training job's curves (loss, learning rate, tokens/s
from its metrics.jsonl; for RL per iteration the rollout reward, the share of groups with no signal, KL and clip
fraction from its iterations.jsonl); a trajectory browser (the first run's evaluated trajectories per question and
method) and an MCTS tree viewer (the first run's mcts job: trees.jsonl with its judged sibling pairs.jsonl).

`prorag eval` saves no PRM score per step of an evaluated trajectory, so steps are coloured by their kind and by the
reference judge's verdict (prorag.search.judging.judge_step against the world's gold decomposition), computed here where
the world's split is on disk and the trajectory kept its retrieved documents (the agents'); never by an invented score.

Large runs are capped (MAX_* below) and the page says what it left out.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from google.protobuf.json_format import ParseDict

from prorag import paths
from prorag.data.loaders import load_split
from prorag.io import atomic_path
from prorag.pb import common_pb2
from prorag.rpc.pbconv import step_from_pb
from prorag.search.judging import judge_step
from prorag.trajectory import Step, parse_step
from prorag_app.report_parts import HOP_GROUPS, pct, svg_of

#: questions of the first run whose trajectories are embedded (the split's first ones)
MAX_QUESTIONS = 200
#: MCTS trees embedded (the job's first ones) and nodes per tree (breadth first)
MAX_TREES = 30
MAX_TREE_NODES = 400
#: characters kept of a document's text, a thought or a step's text
MAX_DOC_CHARS = 800
MAX_TEXT_CHARS = 600
#: points per training curve (evenly thinned, the last kept)
MAX_POINTS = 400


def _jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file a job may still be appending to: a torn or blank line is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _thin(points: list, n: int = MAX_POINTS) -> list:
    if len(points) <= n:
        return points
    stride = math.ceil(len(points) / n)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def _cut(text: str | None, n: int = MAX_TEXT_CHARS) -> str:
    text = text or ""
    return text if len(text) <= n else text[:n] + "…"


# ---------------------------------------------------------------- training curves
def run_jobs(results: dict) -> list[tuple[str, str]]:
    """(role, job id) of every trainer job a run's results.json names: the stage-1 methods' (``jobs``), stage 2's
    (``prm.jobs``: mcts, prm) and stages 3-4's (``stage34.jobs``)."""
    out = [(m, j["job_id"]) for m, j in (results.get("jobs") or {}).items() if isinstance(j, dict) and j.get("job_id")]
    out += list(((results.get("prm") or {}).get("jobs") or {}).items())
    out += list(((results.get("stage34") or {}).get("jobs") or {}).items())
    return [(str(role), str(job)) for role, job in out if job]


def job_run_dir(job_id: str) -> tuple[Path, str]:
    """(the job's run directory, its stage) under the trainer's jobs root (runs/jobs, as `prorag run` uses it)."""
    root = paths.runs_dir() / "jobs" / job_id
    rec = {}
    if (root / "job.json").is_file():
        try:
            rec = json.loads((root / "job.json").read_text())
        except json.JSONDecodeError:
            rec = {}
    run_dir = root / "run"
    if not run_dir.is_dir() and rec.get("run_dir"):
        run_dir = Path(rec["run_dir"])
    stage = rec.get("stage") or ""
    if not stage and (run_dir / "manifest.json").is_file():
        try:
            stage = json.loads((run_dir / "manifest.json").read_text()).get("stage", "")
        except json.JSONDecodeError:
            stage = ""
    return run_dir, str(stage)


def job_curves(job_id: str) -> dict:
    """{"stage", "panels": {title: {"x": axis label, "lines": {label: [[x, y], ...]}}}} of one job: the training
    loop's rows of metrics.jsonl (loss, learning rate, tokens/s per logged optimizer step) and, for RL, one point per
    iteration of iterations.jsonl."""
    run_dir, stage = job_run_dir(job_id)
    panels: dict[str, dict] = {}

    def add(title: str, x_label: str, label: str, points: list) -> None:
        if points:
            panels.setdefault(title, {"x": x_label, "lines": {}})["lines"][label] = _thin(points)

    # RL also logs one row per iteration to metrics.jsonl; the loop's own rows are those with a loss
    steps = [r for r in _jsonl(run_dir / "metrics.jsonl") if "loss" in r and "step" in r]
    for key, title in (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s")):
        add(title, "optimizer step", key, [[r["step"], r[key]] for r in steps if key in r])
    its = _jsonl(run_dir / "iterations.jsonl")

    def per_iteration(value) -> list:
        out = []
        for r in its:
            v = value(r)
            if v is not None:
                out.append([int(r.get("iteration", 0)) + 1, v])
        return out

    def share(part: str):
        return lambda r: r[part] / r["groups"] if part in r and r.get("groups") else None

    add("rollout reward", "RL iteration", "reward", per_iteration(lambda r: r.get("reward_mean")))
    add("rollout reward", "RL iteration", "F1", per_iteration(lambda r: r.get("f1_mean")))
    add("groups with no signal", "RL iteration", "all rollouts alike", per_iteration(share("groups_flat")))
    add("groups with no signal", "RL iteration", "no rollout credited", per_iteration(share("groups_uncredited")))
    add("KL", "RL iteration", "kl", per_iteration(lambda r: r.get("kl")))
    add("KL", "RL iteration", "approx_kl", per_iteration(lambda r: r.get("approx_kl")))
    add("clip fraction", "RL iteration", "clip fraction", per_iteration(lambda r: r.get("clip_fraction")))
    return {"stage": stage, "run_dir": str(run_dir), "panels": panels}


def curves_svg(panels: dict) -> str:
    import matplotlib  # heavy; only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 2.3 * rows), squeeze=False)
    for ax, (title, panel) in zip(axes.flat, panels.items()):
        for k, (label, pts) in enumerate(panel["lines"].items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) <= 30 else None, markersize=3,
                    color=f"C{k % 10}", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(panel["x"], fontsize=8)
        ax.tick_params(labelsize=7)
        if len(panel["lines"]) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    try:
        return svg_of(fig)
    finally:
        plt.close(fig)


def training_sections(runs: list[dict]) -> list[dict]:
    """One entry per distinct job of the runs: {"job_id", "role", "stage", "runs": [1-based run numbers],
    "svg" (None: the job logged no curve, e.g. MCTS, which trains nothing), "run_dir"}."""
    jobs: dict[str, dict] = {}
    for i, r in enumerate(runs, 1):
        for role, job_id in run_jobs(r["results"]):
            entry = jobs.setdefault(job_id, {"job_id": job_id, "role": r.get("names", {}).get(role, role), "runs": []})
            if i not in entry["runs"]:
                entry["runs"].append(i)
    for entry in jobs.values():
        curves = job_curves(entry["job_id"])
        entry["stage"], entry["run_dir"] = curves["stage"], curves["run_dir"]
        entry["svg"] = curves_svg(curves["panels"]) if curves["panels"] else None
    return list(jobs.values())


# ---------------------------------------------------------------- trajectories
class _Docs:
    """The page's one table of documents (by id), so a document several methods or tree nodes retrieved is
    embedded once."""

    def __init__(self):
        self.table: dict[str, dict] = {}

    def add(self, doc_id: str, title: str, text: str) -> str:
        key = doc_id or f"anon{len(self.table)}"
        if key not in self.table:
            self.table[key] = {"title": title, "text": _cut(text, MAX_DOC_CHARS)}
        return key


def _core_steps(record: dict):
    """(core Steps, whether they kept their retrieved documents) of one saved prediction record: an agent's
    trajectory (prorag.v1.Trajectory as JSON), a single-search record's steps, or a baseline's generated answer."""
    if isinstance(record.get("trajectory"), dict):
        return [step_from_pb(ParseDict(s, common_pb2.Step(), ignore_unknown_fields=True))
                for s in record["trajectory"].get("steps") or []], True
    if isinstance(record.get("steps"), list):
        return [Step(str(s.get("kind", "invalid")), thought=str(s.get("thought", "")),
                     content=str(s.get("content", ""))) for s in record["steps"] if isinstance(s, dict)], False
    if isinstance(record.get("generated"), str):
        return [parse_step(record["generated"])], False
    return [], False


def _world_questions(world: str | None, split: str) -> dict:
    """The world's questions of ``split`` by id ({} when the world is not on disk: no judge verdicts then)."""
    if not world:
        return {}
    try:
        return {q.id: q for q in load_split(paths.world_dir(world), split)}
    except (FileNotFoundError, ValueError):
        return {}


def trajectories(run: dict, docs: _Docs, max_questions: int) -> dict:
    """The first run's evaluated questions for the browser: {"questions": [{"id", "question", "golden_answers",
    "hops", "type", "methods": {method: {"prediction", "f1", "em", "finish_reason", "steps", "retrieved_ids"}}}],
    "total", "split", "judged": whether any step has the reference judge's verdict}."""
    results = run["results"]
    split = results.get("split") or "test"
    world_qs = _world_questions(results.get("world"), split)
    ids = list(dict.fromkeys(q for recs in run["records"].values() for q in recs))
    out, judged = [], False
    for qid in ids[:max_questions]:
        first = next(recs[qid] for recs in run["records"].values() if qid in recs)
        gold_q = world_qs.get(qid)
        item = {"id": qid, "question": first.get("question", ""), "golden_answers": first.get("golden_answers", []),
                "hops": first.get("hops"), "type": first.get("type"), "methods": {}}
        for method, recs in run["records"].items():
            rec = recs.get(qid)
            if rec is None:
                continue
            steps, with_docs = _core_steps(rec)
            rows = []
            for i, s in enumerate(steps):
                row = {"kind": s.kind, "thought": _cut(s.thought), "content": _cut(s.content)}
                if not s.valid:  # what the model wrote that did not parse (often only blanks)
                    row["text"] = _cut(s.text.strip()) or "(blank)"
                if s.docs is not None:
                    row["docs"] = [[docs.add(d.id, d.title, d.text or d.contents), round(float(d.score), 4),
                                    int(d.rank)] for d in s.docs]
                # the subanswer rule checks the retrieved documents: only a trajectory that kept them is judged
                if with_docs and gold_q is not None and gold_q.decomposition:
                    v = judge_step(gold_q, steps[:i], s)
                    row["verdict"] = {"sound": bool(v.sound), "reason": v.reason}
                    judged = True
                rows.append(row)
            item["methods"][method] = {
                "prediction": rec.get("prediction"), "f1": rec.get("f1"), "em": rec.get("em"),
                "finish_reason": rec.get("finish_reason", ""), "format_valid": rec.get("format_valid"),
                "steps": rows, "retrieved_ids": rec.get("retrieved_ids") or []}
        out.append(item)
    return {"questions": out, "total": len(ids), "split": split, "judged": judged,
            "world_found": bool(world_qs)}


# ---------------------------------------------------------------- MCTS trees
def _step_key(step: dict | None) -> str:
    if not step:
        return ""
    return step.get("text") or f"{step.get('kind')}\n{step.get('content')}"


def _tree(row: dict, pairs: list[dict], docs: _Docs, max_nodes: int) -> dict:
    """One saved tree for the viewer: nodes breadth first up to ``max_nodes``, each with the sibling pairs among its
    children (matched by the steps' text) and their labels."""
    root = row.get("tree") or {}
    keep, queue = set(), [root]
    while queue and len(keep) < max_nodes:
        node = queue.pop(0)
        keep.add(id(node))
        queue.extend(node.get("children") or [])
    by_path: dict[tuple, dict] = {}

    def build(node: dict, path: tuple) -> dict:
        step = node.get("step")
        out = {"kind": (step or {}).get("kind") or "root", "content": _cut((step or {}).get("content")),
               "thought": _cut((step or {}).get("thought")), "visits": node.get("visits", 0),
               "value": node.get("value", 0.0), "terminal": bool(node.get("terminal")), "reward": node.get("reward"),
               "children": [], "pairs": []}
        if step and out["kind"] == "invalid":
            out["text"] = _cut((step.get("text") or "").strip()) or "(blank)"
        if step and step.get("docs") is not None:
            out["docs"] = [[docs.add(str(d.get("id", "")), str(d.get("title", "")),
                                     str(d.get("text") or d.get("contents") or "")), 0.0, i + 1]
                           for i, d in enumerate(step["docs"])]
        kids = node.get("children") or []
        out["child_keys"] = [_step_key(c.get("step")) for c in kids if id(c) in keep]
        out["children"] = [build(c, path + (_step_key(c.get("step")),)) for c in kids if id(c) in keep]
        out["more"] = sum(id(c) not in keep for c in kids)
        by_path[path] = out
        return out

    tree = build(root, ())
    unmatched = 0
    for p in pairs:
        node = by_path.get(tuple(_step_key(s) for s in p.get("context") or []))
        steps = p.get("steps") or []
        keys = node["child_keys"] if node else []
        idx = [keys.index(_step_key(s)) if _step_key(s) in keys else None for s in steps]
        if node is None or len(idx) != 2 or None in idx:
            unmatched += 1  # its parent or a sibling lies beyond the node cap
            continue
        node["pairs"].append({"a": idx[0], "b": idx[1], "values": p.get("values"), "visits": p.get("visits"),
                              "value_choice": p.get("value_choice"), "judge_choice": p.get("judge_choice"),
                              "judge_reason": _cut(p.get("judge_reason"), 300)})
    for node in by_path.values():
        node.pop("child_keys")
    question = next((p.get("question") for p in pairs if p.get("question")), "")
    return {"question_id": row.get("question_id", ""), "question": question, "stats": row.get("stats") or {},
            "root": tree, "nodes": len(keep), "pairs": len(pairs), "unmatched_pairs": unmatched}


def mcts_trees(runs: list[dict], docs: _Docs, max_trees: int, max_nodes: int) -> dict:
    """The saved trees of the first run that ran stage 2: {"job_id", "trees", "total", "capped_nodes"}."""
    for r in runs:
        prm = r["results"].get("prm") or {}
        job_id = (prm.get("jobs") or {}).get("mcts")
        if not job_id:
            continue
        run_dir, _ = job_run_dir(job_id)
        if not (run_dir / "trees.jsonl").is_file() and prm.get("pairs_path"):
            run_dir = Path(prm["pairs_path"]).parent
        rows = _jsonl(run_dir / "trees.jsonl")
        pairs: dict[str, list] = {}
        for p in _jsonl(run_dir / "pairs.jsonl"):
            pairs.setdefault(str(p.get("question_id", "")), []).append(p)
        trees = [_tree(row, pairs.get(str(row.get("question_id", "")), []), docs, max_nodes)
                 for row in rows[:max_trees]]
        return {"job_id": job_id, "trees": trees, "total": len(rows),
                "capped_nodes": sum(t["nodes"] >= max_nodes for t in trees)}
    return {"job_id": None, "trees": [], "total": 0, "capped_nodes": 0}


# ---------------------------------------------------------------- the page
def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _ci(bounds) -> str:
    return f"[{100 * bounds[0]:+.1f}, {100 * bounds[1]:+.1f}]" if bounds else "- (one seed)"


def _methods_table(report: dict) -> str:
    def cell(stat) -> str:
        if not stat:
            return "<td>-</td>"
        return f"<td>{pct(stat['f1'])} <span class=ci>[{pct(stat['f1_ci'][0])}, {pct(stat['f1_ci'][1])}]</span></td>"

    head = "".join(f"<th>{h}-hop</th>" for h in HOP_GROUPS)
    rows = []
    for m, s in report["methods"].items():
        rows.append(f"<tr><td>{_e(m)}</td><td>{report['seeds'][m]}</td>{cell(s['overall'])}"
                    + "".join(cell(s["by_hops"].get(h)) for h in HOP_GROUPS)
                    + f"{cell(s.get('multi_hop'))}<td>{pct(s['overall']['em'])}</td><td>{s['overall']['n']}</td></tr>")
    return (f"<table id=methods-table><thead><tr><th>method</th><th>seeds</th><th>overall F1</th>{head}"
            f"<th>2+ hops</th><th>EM</th><th>n</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _comparisons_table(report: dict) -> str:
    if not report["comparisons"]:
        return "<p class=note>No paired comparisons: these runs evaluated none of the compared pairs of methods.</p>"
    rows = []
    for name, c in report["comparisons"].items():
        ci = c.get("ci")
        # a difference whose question interval excludes 0 is marked, by its sign
        sign = "pos" if ci and ci[0] > 0 else "neg" if ci and ci[1] < 0 else ""
        rows.append(f"<tr class='{sign}'><td>{_e(name)}</td><td>{_e(c['group'])}</td><td>{pct(c['a_mean'])}</td>"
                    f"<td>{pct(c['b_mean'])}</td><td>{100 * c['f1_diff']:+.1f}</td><td>{_ci(ci)}</td>"
                    f"<td>{_ci(c.get('ci_seeds_questions'))}</td><td>{c['n']}</td><td>{c['seeds']}</td>"
                    f"<td>{c.get('wins', '-')}/{c.get('losses', '-')}/{c.get('ties', '-')}</td></tr>")
    return ("<table id=comparisons-table><thead><tr><th>A vs B</th><th>group</th><th>A</th><th>B</th><th>A - B</th>"
            "<th>95% CI, questions</th><th>95% CI, seeds and questions</th><th>n</th><th>seeds</th>"
            f"<th>wins/losses/ties</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _claim_table(report: dict) -> str:
    """report["claim"] (prorag_app.report.claim_links): each link of the chain, its interval and status."""
    claim = report.get("claim")
    if not claim:
        return ""
    rows = []
    for lk in claim["links"]:
        what = (f"{100 * lk['diff']:+.1f} {_ci(lk['ci'])}" + (" seeds and questions" if lk.get("ci_includes_seeds")
                                                             else " questions")) if "ci" in lk else \
            _e("; ".join(lk.get("reasons") or []) or "-")
        cls = "pos" if lk["status"] == "holds" else "neg" if lk["status"] in ("fails", "reversed") else ""
        rows.append(f"<tr class='{cls}'><td>{_e(lk['link'])}</td><td>{_e(lk.get('comparison', 'PRM gate'))}</td>"
                    f"<td>{what}</td><td>{_e(lk['status'])}</td></tr>")
    first = (f"First link that does not hold: <b>{_e(claim['first_failed'])}</b>." if claim["first_failed"]
             else "Every link holds.")
    return ("<h3>Where the claim stands</h3><table id=claim-table><thead><tr><th>link</th><th>read from</th>"
            f"<th>A - B [95% CI]</th><th>status</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<p class=note>{first}</p>")


def _errors_table(report: dict) -> str:
    """report["errors"] (prorag_app.report.error_shares): why each method's 3+ hop answers are wrong, % of them."""
    errors = report.get("errors")
    if not errors:
        return ""
    kinds = list(next(iter(errors.values()))["counts"])
    rows = "".join(f"<tr><td>{_e(m)}</td><td>{row['n']}</td>"
                   + "".join(f"<td>{100 * row['counts'][k] / row['n']:.1f}</td>" for k in kinds) + "</tr>"
                   for m, row in errors.items())
    return ("<h3>Why answers are wrong</h3><p class=note>Questions of 3+ hops, answers summed over seeds, % of them; "
            "read along each question's gold chain at the first hop the agent never resolved "
            "(<code>prorag diagnose errors</code>).</p><table id=errors-table><thead><tr><th>method</th>"
            "<th>answers</th>" + "".join(f"<th>{_e(k)}</th>" for k in kinds)
            + f"</tr></thead><tbody>{rows}</tbody></table>")


def _figure(name: str, caption: str, svg: str) -> str:
    return f"<figure class=plot data-plot='{_e(name)}'>{svg}<figcaption>{_e(caption)}</figcaption></figure>"


PLOT_CAPTIONS = {
    "f1_by_hops": "F1 x100 per hop count, with 95% CIs over questions (seed-averaged)",
    "beta": "ProRAG's F1 on 3+ hop questions against beta",
    "data_efficiency": "F1 on 3+ hop questions against RL questions seen (RL adapters evaluated after some iterations)",
    "rl_curves": "the RL jobs' rollout F1 against RL questions seen (train questions)",
}


def _json_script(data) -> str:
    # "<", ">" and "&" as JSON escapes: no text in the data can close the script element
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _finite(obj):
    """NaN and infinities (not JSON) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_html(report: dict, runs: list[dict], html_dir: str | Path, svgs: dict[str, str]) -> Path:
    """Write ``html_dir``/index.html for ``report`` (build_report's) over the loaded ``runs``; returns its path."""
    docs = _Docs()
    traj = trajectories(runs[0], docs, MAX_QUESTIONS)
    trees = mcts_trees(runs, docs, MAX_TREES, MAX_TREE_NODES)
    jobs = training_sections(runs)
    data = _finite({"trajectories": traj, "trees": trees, "docs": docs.table})

    results_plots = "".join(_figure(n, PLOT_CAPTIONS[n], svgs[n]) for n in ("f1_by_hops",) if n in svgs)
    ablation = "".join(_figure(n, PLOT_CAPTIONS[n], svgs[n]) for n in ("beta", "data_efficiency", "rl_curves")
                       if n in svgs)
    if not ablation:
        ablation = ("<p class=note>No ablation in these runs: the beta sweep needs runs at several betas, data "
                    "efficiency RL adapters evaluated after some iterations (`prorag run --profile ablation`).</p>")
    job_html = []
    for j in jobs:
        title = (f"{_e(j['stage'] or '?')}: {_e(j['role'])} <span class=muted>job {_e(j['job_id'])}, run(s) "
                 f"{', '.join(map(str, j['runs']))}</span>")
        body = (_figure(f"job:{j['job_id']}", f"{j['stage']} ({j['role']})", j["svg"]) if j["svg"] else
                f"<p class=note>No training curve: {_e(j['run_dir'])} holds no metrics.jsonl rows with a loss nor an "
                "iterations.jsonl (a search stage such as mcts trains nothing; or the job directory is elsewhere).</p>")
        job_html.append(f"<section class=job data-job='{_e(j['job_id'])}'><h3>{title}</h3>{body}</section>")
    if not job_html:
        job_html.append("<p class=note>These runs' results.json name no trainer job.</p>")
    shown, total = len(traj["questions"]), traj["total"]
    traj_note = (f"{shown} of the first run's {total} evaluated questions ({_e(traj['split'])} split"
                 + (f"; the first {shown}, the page's cap" if shown < total else "") + ")"
                 + ("; the deep split's trajectories are not embedded" if runs[0].get("deep") else "") + ". "
                 "Documents are cut to {} characters. `prorag eval` saves no PRM score per step, so steps are "
                 "coloured by kind, and ".format(MAX_DOC_CHARS)
                 + ("by the reference judge's verdict (gold decomposition; agent trajectories, which keep their "
                    "documents): green sound, red unsound." if traj["judged"] else
                    "no judge verdict is shown (" + ("the world's questions are not on this machine"
                                                     if not traj["world_found"] else
                                                     "no trajectory kept its retrieved documents") + ")."))
    tree_note = ("No MCTS trees: no run of these ran stage 2 (or its job directory is not under runs/jobs)."
                 if not trees["trees"] else
                 f"{len(trees['trees'])} of the {trees['total']} trees of mcts job {_e(trees['job_id'])}"
                 + (f" (the first {len(trees['trees'])}, the page's cap)" if len(trees["trees"]) < trees["total"]
                    else "")
                 + f"; at most {MAX_TREE_NODES} nodes per tree, breadth first"
                 + (f" ({trees['capped_nodes']} tree(s) cut)" if trees["capped_nodes"] else "")
                 + ". Node colour: its mean backed-up value (red low, green high, per tree); badges: the labels of "
                   "the sibling pairs it is in (judge and value margin).")
    body = f"""
<header><h1>Report: {len(report['runs'])} run(s) on world <code>{_e(report['world'])}</code></h1>
<p class=muted>{'<br>'.join(_e(r) for r in report['runs'])}</p>
<p class=note>{_e(report.get('budget', ''))}</p>
<nav><a href="#results">Results</a> <a href="#comparisons">Comparisons</a> <a href="#ablations">Ablations</a>
<a href="#training">Training curves</a> <a href="#trajectories">Trajectories</a> <a href="#trees">MCTS trees</a></nav>
</header>
<section id=results><h2>Results</h2>
<p class=note>F1 x100 [95% CI over questions of the seed-averaged F1]; seeds = runs that evaluated the method.</p>
{_methods_table(report)}{_errors_table(report)}{results_plots}</section>
<section id=comparisons><h2>Paired comparisons</h2>
<p class=note>A minus B per question over the pooled seeds. 95% CI over questions of the seed-averaged differences;
and, with 2+ seeds, resampling seeds then questions (training noise in the interval too). Rows whose question CI
excludes 0 are shaded by its sign.</p>{_comparisons_table(report)}{_claim_table(report)}</section>
<section id=ablations><h2>Ablations</h2>{ablation}</section>
<section id=training><h2>Training curves</h2>
<p class=note>Per trainer job of these runs: loss, learning rate and tokens/s per logged optimizer step
(metrics.jsonl); for RL, per iteration (iterations.jsonl), the rollout reward and F1, the share of rollout groups with
no signal (all rollouts rewarded alike; none credited), KL and clip fraction. Curves keep at most {MAX_POINTS} points.
</p>{''.join(job_html)}</section>
<section id=trajectories><h2>Trajectories</h2><p class=note>{traj_note}</p>
<div class=toolbar><input id=traj-search type=search placeholder="search a question, its id or answer"
 aria-label="search questions"> <span id=traj-count></span></div>
<div class=browser><ul id=traj-list></ul><div id=traj-view></div></div></section>
<section id=trees><h2>MCTS trees</h2><p class=note>{tree_note}</p>
<div class=toolbar><select id=tree-select aria-label="tree"></select></div><div id=tree-view></div></section>
<script type="application/json" id=report-data>{_json_script(data)}</script>
<script>{_SCRIPT}</script>
"""
    page = (f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>ProRAG report: {_e(report['world'])}"
            f"</title><meta name=viewport content='width=device-width, initial-scale=1'><style>{_STYLE}</style></head>"
            f"<body>{body}</body></html>\n")
    html_dir = Path(html_dir)
    html_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(html_dir / "index.html") as tmp:
        tmp.write_text(page, encoding="utf-8")
    return html_dir / "index.html"


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1400px;padding:0 1.2em 3em;color:#222}
h1{font-size:1.4em}h2{border-bottom:1px solid #ccc;padding-top:.6em}h3{font-size:1em;margin:.8em 0 .3em}
nav a{margin-right:1em}.muted,.ci{color:#777;font-size:.9em}.note{color:#555;max-width:70em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
td:first-child,th:first-child{text-align:left}tr.pos{background:#e6f4e6}tr.neg{background:#f8e3e3}
figure.plot{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top}figure svg{max-width:100%;height:auto}
figcaption{color:#555;font-size:.85em;max-width:36em}
.toolbar{margin:.5em 0}#traj-search{width:30em;max-width:90%;padding:3px}
.browser{display:flex;gap:1em;align-items:flex-start}
#traj-list{list-style:none;margin:0;padding:0;width:22em;max-height:70vh;overflow:auto;flex:none;border:1px solid #ddd}
#traj-list li{padding:3px 6px;cursor:pointer;border-bottom:1px solid #eee}#traj-list li.sel{background:#dde8f8}
#traj-view{flex:1;min-width:0}.methods{display:flex;flex-wrap:wrap;gap:.8em}
.method{border:1px solid #ccc;border-radius:4px;padding:.4em;flex:1 1 22em;min-width:18em}
.method h4{margin:0 0 .3em}.steps{margin:0;padding-left:1.6em}
.step{margin:.25em 0;padding:.25em .4em;border-left:5px solid #999;background:#f6f6f6;border-radius:2px}
.step.kind-subquery{border-left-color:#3b73c4}.step.kind-subanswer{border-left-color:#8a5cc2}
.step.kind-answer{border-left-color:#d08a1e}.step.kind-invalid{border-left-color:#555}
.step.verdict-sound{background:#e3f3e3}.step.verdict-unsound{background:#f8e0e0}
.badge{display:inline-block;font-size:.75em;padding:0 4px;border-radius:3px;background:#ddd;margin-right:4px}
.thought{color:#666;font-style:italic}.doc{margin:.2em 0 .2em 1em;font-size:.9em}pre{white-space:pre-wrap;margin:0}
ul.tree,ul.tree ul{list-style:none;padding-left:1.3em;margin:0}ul.tree li{margin:2px 0}
.nodelabel{padding:1px 4px;border-radius:3px}.b-chosen{background:#bfe5bf}.b-rejected{background:#f2c4c4}
.pairs td{font-size:.85em;text-align:left}
"""

# The viewers: vanilla JS reading the inline JSON; text is set through textContent, never parsed as HTML.
# On load it sets body[data-ready]=1; any error (caught or not) is appended to body[data-errors].
_SCRIPT = r"""
(function () {
  "use strict";
  var errors = [];
  function fail(msg) {
    errors.push(String(msg));
    document.body.setAttribute("data-errors", errors.join("\n"));
  }
  window.addEventListener("error", function (ev) { fail(ev.message + " (" + ev.filename + ":" + ev.lineno + ")"); });

  function el(tag, attrs, kids) {
    var n = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") n.textContent = attrs[k];
      else n.setAttribute(k, attrs[k]);
    });
    (kids || []).forEach(function (c) {
      if (c) n.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return n;
  }
  function fmt(v, d) { return v === null || v === undefined ? "-" : Number(v).toFixed(d === undefined ? 3 : d); }

  var DATA = JSON.parse(document.getElementById("report-data").textContent);

  function docsEl(docs, label) {
    if (!docs || !docs.length) return null;
    return el("details", {"class": "docs"}, [el("summary", {text: docs.length + " " + label})].concat(
      docs.map(function (d) {
        var doc = DATA.docs[d[0]] || {title: d[0], text: ""};
        return el("div", {"class": "doc"}, [el("b", {text: (d[2] ? "#" + d[2] + " " : "") + doc.title}),
          d[1] ? el("span", {"class": "muted", text: " score " + fmt(d[1])}) : null, el("div", {text: doc.text})]);
      })));
  }

  // ---- trajectory browser
  function stepEl(s, i) {
    var cls = "step kind-" + s.kind + (s.verdict ? (s.verdict.sound ? " verdict-sound" : " verdict-unsound") : "");
    var head = [el("span", {"class": "badge", text: (i + 1) + " " + s.kind})];
    if (s.verdict) head.push(el("span", {"class": "badge verdict", title: s.verdict.reason,
                                        text: (s.verdict.sound ? "\u2713 " : "\u2717 ") + s.verdict.reason}));
    return el("li", {"class": cls, "data-kind": s.kind}, head.concat([
      s.thought ? el("div", {"class": "thought", text: s.thought}) : null,
      s.content ? el("div", {"class": "content", text: s.content}) : null,
      s.text ? el("pre", {text: s.text}) : null,
      docsEl(s.docs, "retrieved documents")]));
  }

  function methodEl(name, m) {
    var kids = [el("h4", {text: name}),
      el("div", {"class": "muted", text: "F1 " + fmt(m.f1, 2) + " \u00b7 EM " + fmt(m.em, 0) +
        (m.finish_reason ? " \u00b7 " + m.finish_reason : "") + " \u00b7 prediction: " +
        (m.prediction === null || m.prediction === undefined ? "(none)" : m.prediction)}),
      el("ol", {"class": "steps"}, m.steps.map(stepEl))];
    if (m.retrieved_ids && m.retrieved_ids.length)
      kids.push(el("details", {}, [
        el("summary", {text: m.retrieved_ids.length + " retrieved documents (ids only saved)"}),
                                   el("div", {"class": "doc", text: m.retrieved_ids.join(", ")})]));
    return el("div", {"class": "method", "data-method": name}, kids);
  }

  function initTrajectories() {
    var T = DATA.trajectories, input = document.getElementById("traj-search");
    var list = document.getElementById("traj-list"), view = document.getElementById("traj-view");
    var count = document.getElementById("traj-count"), current = null, LIST_MAX = 300;
    function show(q) {
      current = q;
      Array.prototype.forEach.call(list.children, function (li) {
        li.classList.toggle("sel", li.dataset.id === q.id);
      });
      view.replaceChildren(el("div", {"class": "question", "data-id": q.id}, [
        el("h3", {text: q.question}),
        el("div", {"class": "muted", text: q.id + " \u00b7 " + q.hops + " hops \u00b7 " + q.type + " \u00b7 gold: " +
                                           (q.golden_answers || []).join(" | ")}),
        el("div", {"class": "methods"}, Object.keys(q.methods).map(function (m) {
          return methodEl(m, q.methods[m]);
        }))]));
    }
    function refresh() {
      var words = input.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
      var hits = T.questions.filter(function (q) {
        var hay = (q.question + " " + q.id + " " + (q.golden_answers || []).join(" ")).toLowerCase();
        return words.every(function (w) { return hay.indexOf(w) >= 0; });
      });
      count.textContent = hits.length + " of " + T.questions.length + " questions" +
        (hits.length > LIST_MAX ? " (first " + LIST_MAX + " listed)" : "");
      list.replaceChildren.apply(list, hits.slice(0, LIST_MAX).map(function (q) {
        var li = el("li", {"data-id": q.id, text: q.question});
        li.addEventListener("click", function () { show(q); });
        return li;
      }));
      if (!hits.length) {
        current = null;
        view.replaceChildren(el("p", {"class": "note", text: "No question matches."}));
      }
      else if (hits.indexOf(current) < 0) show(hits[0]);
      else show(current);
    }
    input.addEventListener("input", refresh);
    var m = /[#&]q=([^&]*)/.exec(location.hash);
    if (m) input.value = decodeURIComponent(m[1].replace(/\+/g, " "));
    if (!T.questions.length) {
      view.replaceChildren(el("p", {"class": "note", text: "No saved predictions."}));
      return;
    }
    refresh();
  }

  // ---- MCTS tree viewer
  function nodeEl(n, depth, lo, hi, badges) {
    var t = hi > lo ? (n.value - lo) / (hi - lo) : 0.5;
    var label = el("span", {"class": "nodelabel", style: "background:hsl(" + Math.round(120 * t) + ",60%,85%)"}, [
      el("span", {"class": "badge", text: n.kind}),
      (n.content || n.text || (n.kind === "root" ? "question" : "")) + " ",
      el("span", {"class": "muted", text: "visits " + n.visits + " \u00b7 value " + fmt(n.value) +
        (n.terminal ? " \u00b7 terminal, reward " + fmt(n.reward) : "")})].concat(badges || []));
    var inner = [];
    if (n.thought) inner.push(el("div", {"class": "thought", text: n.thought}));
    inner.push(docsEl(n.docs, "retrieved documents"));
    if (n.pairs.length) {
      inner.push(el("details", {"class": "pairs"}, [el("summary", {text: n.pairs.length + " sibling pair(s) labelled"}),
        el("table", {}, [el("tr", {}, ["children", "values", "visits", "value label", "judge", "judge's reason"].map(
          function (h) { return el("th", {text: h}); }))].concat(n.pairs.map(function (p) {
          function pick(c) { return c === null || c === undefined ? "none" : "#" + ((c === 0 ? p.a : p.b) + 1); }
          return el("tr", {}, ["#" + (p.a + 1) + " vs #" + (p.b + 1),
            (p.values || []).map(function (v) { return fmt(v); }).join(" / "),
            (p.visits || []).join(" / "), pick(p.value_choice), pick(p.judge_choice), p.judge_reason || ""].map(
            function (c) { return el("td", {text: c}); }));
        })))]));
    }
    var kidBadges = n.children.map(function () { return []; });
    n.pairs.forEach(function (p) {
      [["judge", p.judge_choice], ["value", p.value_choice]].forEach(function (lab) {
        if (lab[1] === null || lab[1] === undefined) return;
        var win = lab[1] === 0 ? p.a : p.b, lose = lab[1] === 0 ? p.b : p.a;
        var why = p.judge_reason || "";
        kidBadges[win].push(el("span", {"class": "badge b-chosen", title: why, text: lab[0] + " \u2713"}));
        kidBadges[lose].push(el("span", {"class": "badge b-rejected", title: why, text: lab[0] + " \u2717"}));
      });
    });
    if (n.children.length || n.more)
      inner.push(el("ul", {}, n.children.map(function (c, i) { return nodeEl(c, depth + 1, lo, hi, kidBadges[i]); })
        .concat(n.more ? [el("li", {"class": "muted", text: n.more + " more child(ren) beyond the cap"})] : [])));
    var body = inner.filter(Boolean);
    if (!body.length) return el("li", {"class": "node leaf", "data-kind": n.kind}, [label]);
    var d = el("details", {}, [el("summary", {}, [label])].concat(body));
    if (depth < 2) d.open = true;
    return el("li", {"class": "node", "data-kind": n.kind}, [d]);
  }

  function initTrees() {
    var T = DATA.trees, select = document.getElementById("tree-select"), view = document.getElementById("tree-view");
    if (!T.trees.length) { select.hidden = true; return; }
    T.trees.forEach(function (t, i) {
      select.appendChild(el("option", {value: String(i), text: t.question_id + ": " + t.question + " (" + t.nodes +
                                                               " nodes, " + t.pairs + " pairs)"}));
    });
    function show(i) {
      var t = T.trees[i], values = [];
      (function walk(n) { values.push(n.value); n.children.forEach(walk); })(t.root);
      var lo = Math.min.apply(null, values), hi = Math.max.apply(null, values);
      view.replaceChildren(el("div", {"class": "muted", text: "simulations " + (t.stats.simulations || "-") +
          " \u00b7 stopped by " + (t.stats.stopped_by || "-") + (t.unmatched_pairs ? " \u00b7 " + t.unmatched_pairs +
          " pair(s) beyond the node cap not shown" : "")}),
        el("ul", {"class": "tree", "data-question": t.question_id}, [nodeEl(t.root, 0, lo, hi, [])]));
    }
    select.addEventListener("change", function () { show(Number(select.value)); });
    show(0);
  }

  [initTrajectories, initTrees].forEach(function (f) {
    try { f(); } catch (e) { fail((e && e.stack) || e); }
  });
  document.body.dataset.ready = "1";
})();
"""


__all__ = ["MAX_QUESTIONS", "MAX_TREES", "job_curves", "mcts_trees", "run_jobs", "trajectories",
           "write_html"]
