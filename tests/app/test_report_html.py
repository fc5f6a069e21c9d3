"""`prorag report`'s HTML page (prorag_app.report_html), rendered in headless Chromium: every plot is there, the
trajectory browser and the MCTS tree viewer are filled in by the page's script, the search box filters, and the
page raises no script error. Chromium is Debian's `chromium` (`make test` installs it); without it this test fails,
saying so, rather than skipping."""

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from google.protobuf.json_format import MessageToDict

from prorag.data.loaders import Document, Question
from prorag.search.judging import judge_pair
from prorag.search.mcts import Node
from prorag.search.pairs import StepPair
from prorag.pb import policy_pb2
from prorag.rpc.pbconv import step_pb
from prorag.trajectory import Step
from tests.app.test_report import _run

N = 12  # question i has 1 + i % 4 hops, as _run writes them
NAMES = ["Harbour", "Meridian", "Orchard", "Lantern", "Quarry", "Thistle", "Beacon", "Cobalt", "Juniper", "Falcon",
         "Marble", "Saffron"]


def _chain(i: int) -> list[str]:
    """The entities question i walks through: its start entity, then one per hop."""
    return [f"{NAMES[i]} {k}" if k else f"The {NAMES[i]}" for k in range(2 + i % 4)]


def _question(i: int) -> Question:
    chain = _chain(i)
    hops = [{"question": f"Who is linked to {chain[k]}?", "answer": chain[k + 1], "doc_id": f"d{i}_{k}",
             "title": chain[k]} for k in range(len(chain) - 1)]
    return Question(f"q{i}", f"Whom does the chain from {chain[0]} end at?", [chain[-1]],
                    {"hops": len(hops), "type": "compositional", "decomposition": hops})


def _doc(i: int, k: int) -> Document:
    chain = _chain(i)
    return Document(f"d{i}_{k}", chain[k], f"{chain[k]} is linked to {chain[k + 1]}.",
                    f'"{chain[k]}"\n{chain[k]} is linked to {chain[k + 1]}.', score=0.9, rank=1)


def _steps(i: int, right: bool) -> list[Step]:
    """The gold walk of question i; ``right=False`` searches a wrong entity first and answers wrong."""
    chain, steps = _chain(i), []
    if not right:
        steps.append(Step("subquery", thought="I search.", content="Who is linked to Nobody?", docs=[]))
        return steps + [Step("answer", thought="I guess.", content="Nobody")]
    for k in range(len(chain) - 1):
        steps.append(Step("subquery", thought=f"Hop {k + 1}.", content=f"Who is linked to {chain[k]}?",
                          docs=[_doc(i, k)]))
        steps.append(Step("subanswer", thought="Found it.", content=chain[k + 1]))
    return steps + [Step("answer", thought="Done.", content=chain[-1])]


def _agent_record(i: int, right: bool) -> dict:
    """A prediction as `prorag eval` saves an agent's (prorag_app.eval.run_agent): the rollout as JSON."""
    q, steps = _question(i), _steps(i, right)
    traj = policy_pb2.Trajectory(question_id=q.id, question=q.question, steps=[step_pb(s) for s in steps],
                                 answer=steps[-1].content, format_valid=True, finish_reason="answer",
                                 prompt_length=80, text="".join(s.text for s in steps))
    f1 = 1.0 if right else 0.0
    return {"id": q.id, "question": q.question, "golden_answers": q.golden_answers, "prediction": steps[-1].content,
            "hops": q.hops, "type": q.qtype, "em": f1, "f1": f1, "acc": f1, "finish_reason": "answer",
            "format_valid": True, "adapter_version": "", "first_subquery_entity": right,
            "trajectory": MessageToDict(traj, preserving_proto_field_name=True)}


def _write_predictions(run, method: str, records: list[dict]) -> None:
    (run / method).mkdir(parents=True, exist_ok=True)
    (run / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _job(runs_root, job_id: str, stage: str, metrics: list[dict] = (), iterations: list[dict] = ()) -> None:
    run = runs_root / "jobs" / job_id / "run"
    run.mkdir(parents=True)
    (run.parent / "job.json").write_text(json.dumps({"job_id": job_id, "stage": stage, "state": "SUCCEEDED",
                                                     "run_dir": str(run)}))
    if metrics:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if iterations:
        (run / "iterations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in iterations))


def _loop_rows(steps: int, every: int = 2) -> list[dict]:
    """The training loop's rows (prorag.training.loop via JobContext.emit)."""
    return [{"step": s, "loss": 3.0 / s, "lr": 1e-3 * (1 - s / (steps + 1)), "tokens_per_s": 900.0 + s,
             "grad_norm": 1.0, "mfu": 0.1} for s in range(every, steps + 1, every)]


def _rl(runs_root, job_id: str) -> None:
    """An RL job: one row per iteration in iterations.jsonl (stage_rl's journal) and metrics.jsonl (both the
    loop's optimizer steps and the iteration rows)."""
    its = [{"iteration": it, "adapter": f"prorag@v{it}", "questions": 16, "groups": 16, "groups_flat": 12 - it,
            "groups_uncredited": 10 - it, "deep_groups": 8, "deep_groups_uncredited": 6, "reward_mean": 0.1 * it,
            "f1_mean": 0.05 * it, "kl": 0.01 * it, "approx_kl": 0.008 * it, "clip_fraction": 0.02 * it,
            "sampled": 64, "kept": 64, "rollout_s": 1.0, "update_s": 0.5} for it in range(4)]
    metrics = _loop_rows(8, every=1) + [{"step": r["iteration"] + 1, **{k: v for k, v in r.items()
                                                                          if isinstance(v, (int, float))}} for r in its]
    _job(runs_root, job_id, "rl", metrics, its)


def _mcts(runs_root, job_id: str) -> int:
    """An MCTS job's trees.jsonl and pairs.jsonl as stage_mcts writes them (Node.to_dict, StepPair.to_dict), the
    pair judged by the reference rules; returns the first tree's node count."""
    trees, pairs = [], []
    for i in (2, 3):
        q, chain = _question(i), _chain(i)
        root = Node(None, 0, visits=6, value_sum=3.0)
        good = Node(Step("subquery", thought="Hop 1.", content=f"Who is linked to {chain[0]}?", docs=[_doc(i, 0)]),
                    1, parent=root, visits=4, value_sum=3.0)
        bad = Node(Step("subquery", thought="Hmm.", content="Who is linked to Nobody?", docs=[]), 1, parent=root,
                   visits=2, value_sum=0.0)
        deeper = Node(Step("subanswer", thought="Found it.", content=chain[1]), 2, parent=good, visits=3,
                      value_sum=3.0, terminal=False)
        root.children, good.children = [good, bad], [deeper]
        verdict = judge_pair(q, [], good.step, bad.step)
        pairs.append(StepPair(q.id, q.question, [], (good.step, bad.step), values=(good.value, bad.value),
                              visits=(good.visits, bad.visits), value_choice=0, judge_choice=verdict.chosen,
                              judge_reason=verdict.reason).to_dict())
        trees.append({"question_id": q.id, "stats": {"simulations": 6, "tokens": 90, "seconds": 1.0,
                                                     "stopped_by": "simulations"}, "tree": root.to_dict()})
    _job(runs_root, job_id, "mcts")
    run = runs_root / "jobs" / job_id / "run"
    (run / "trees.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
    (run / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return 4


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Three runs of world w1 as `prorag run` leaves them: two stage 3-4 seeds (the first with RL adapters
    evaluated after 3 iterations) and one at another beta; the world's test split on disk; the trainer's jobs."""
    runs_root, data = tmp_path / "runs", tmp_path / "data"
    monkeypatch.setenv("PRORAG_RUNS", str(runs_root))
    monkeypatch.setenv("PRORAG_DATA", str(data))
    world = data / "worlds" / "w1"
    world.mkdir(parents=True)
    (world / "test.jsonl").write_text("".join(json.dumps(_question(i).to_row()) + "\n" for i in range(N)))
    _job(runs_root, "w1-sft-1", "sft", _loop_rows(20))
    _job(runs_root, "w1-prm-1", "prm", _loop_rows(10))
    _rl(runs_root, "w1-rl-prorag-1")
    _rl(runs_root, "w1-rl-outcome-1")
    tree_nodes = _mcts(runs_root, "w1-mcts-1")
    rl = {"seed": 1, "iterations": 10, "questions_per_iteration": 16}
    right = {"sft": lambda i: i % 2 == 0, "outcome_grpo": lambda i: i % 3 != 1, "prorag": lambda i: i != 5,
             "outcome_grpo@it3": lambda i: i % 2 == 0, "prorag@it3": lambda i: i % 3 != 1}
    dirs = []
    for name, seed, beta, methods in (("seed1", 1, 0.3, list(right)), ("seed2", 2, 0.3, ["sft", "prorag"]),
                                      ("beta0.5", 1, 0.5, ["prorag"])):
        # _run writes results.json and every method's directory; the agents' predictions are replaced by saved
        # trajectories, and two baselines are added as `prorag eval` saves theirs
        run = _run(tmp_path, name, {m: [0.0] * N for m in methods}, beta=beta, world="w1", rl={**rl, "seed": seed},
                   job_ids={"prorag": "w1-rl-prorag-1", "outcome_grpo": "w1-rl-outcome-1"})
        for m in methods:
            flip = seed == 2 and m == "prorag"  # the second seed gets one more question wrong
            _write_predictions(run, m, [_agent_record(i, right[m](i) and not (flip and i == 7)) for i in range(N)])
        if name == "seed1":
            base = [{k: v for k, v in _agent_record(i, False).items() if k != "trajectory"} for i in range(N)]
            _write_predictions(run, "standard_rag", [
                {**r, "retrieved_ids": [f"d{i}_0"], "steps": [
                    {"kind": "subquery", "thought": "t", "content": r["question"]},
                    {"kind": "subanswer", "thought": "t", "content": "x"},
                    {"kind": "answer", "thought": "t", "content": "x"}]}
                for i, r in enumerate(base)])
            _write_predictions(run, "no_retrieval", [
                {**r, "generated": Step("answer", thought="I know.", content="Nobody").text} for r in base])
        results = json.loads((run / "results.json").read_text())
        methods_all = methods + (["standard_rag", "no_retrieval"] if name == "seed1" else [])
        results.update({"methods": {m: {} for m in methods_all}, "split": "test",
                        "jobs": {"sft": {"job_id": "w1-sft-1", "model": "sft@w1-sft-1", "metrics": {}}},
                        "prm": {"jobs": {"mcts": "w1-mcts-1", "prm": "w1-prm-1"}}})
        (run / "results.json").write_text(json.dumps(results))
        dirs.append(run)
    return {"dirs": dirs, "tree_nodes": tree_nodes}


class Dom(HTMLParser):
    """The elements of a dumped DOM with their parents and the text under each."""

    VOID = {"meta", "input", "br", "img", "hr", "link", "area", "base", "col", "embed", "source", "track", "wbr"}

    def __init__(self, text: str):
        super().__init__()
        self.els, self.stack = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.els.append({"tag": tag, "attrs": dict(attrs), "parent": self.stack[-1] if self.stack else None,
                         "text": ""})
        if tag not in self.VOID:
            self.stack.append(len(self.els) - 1)

    def handle_startendtag(self, tag, attrs):
        self.els.append({"tag": tag, "attrs": dict(attrs), "parent": self.stack[-1] if self.stack else None,
                         "text": ""})

    def handle_endtag(self, tag):
        while self.stack:
            if self.els[self.stack.pop()]["tag"] == tag:
                break

    def handle_data(self, data):
        for i in self.stack:
            self.els[i]["text"] += data

    def find(self, tag=None, cls=None, under=None, **attrs):
        out = []
        for i, e in enumerate(self.els):
            if tag and e["tag"] != tag:
                continue
            if cls and cls not in (e["attrs"].get("class") or "").split():
                continue
            if any(e["attrs"].get(k.replace("_", "-")) != v for k, v in attrs.items()):
                continue
            if under is not None and not self.inside(i, under):
                continue
            out.append(i)
        return out

    def inside(self, i, ancestor) -> bool:
        p = self.els[i]["parent"]
        while p is not None:
            if p == ancestor:
                return True
            p = self.els[p]["parent"]
        return False

    def one(self, *args, **kw) -> int:
        found = self.find(*args, **kw)
        assert len(found) == 1, (args, kw, len(found))
        return found[0]

    def text(self, i) -> str:
        return self.els[i]["text"]

    def cls(self, i) -> list[str]:
        return (self.els[i]["attrs"].get("class") or "").split()


def _chromium() -> str:
    exe = shutil.which(os.environ.get("PRORAG_CHROMIUM", "chromium"))
    if exe is None:
        pytest.fail("headless Chromium is needed to render the HTML report: `make test` installs Debian's chromium "
                    "(apt-get install chromium); PRORAG_CHROMIUM names another binary")
    return exe


def _render(index, tmp_path, fragment: str = "") -> tuple[Dom, str]:
    """The DOM after the page's script ran, and Chromium's console log."""
    profile = tmp_path / f"chromium-profile{len(list(tmp_path.glob('chromium-profile*')))}"
    cmd = [_chromium(), "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           # nothing may come from the network: every host name fails to resolve
           "--host-resolver-rules=MAP * ~NOTFOUND", "--dump-dom", index.as_uri() + fragment]
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "<body" in r.stdout, r.stderr[-3000:]
    return Dom(r.stdout), r.stderr


def _console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_the_html_report_renders_every_view_in_headless_chromium(runs, tmp_path, capsys):
    from prorag_app.cli import main

    assert main(["report", *map(str, runs["dirs"]), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    index = runs["dirs"][0] / "report" / "index.html"  # the first run's report/, as runs/latest/report
    assert printed.rstrip().endswith(f"html report: {index}")
    assert (tmp_path / "out" / "report.md").is_file()  # the Markdown report as before
    page = index.read_text()
    assert "<script src" not in page and "<link" not in page and "<img" not in page  # one file, nothing fetched

    dom, log = _render(index, tmp_path)
    body = dom.one("body")
    assert dom.els[body]["attrs"].get("data-ready") == "1"
    assert "data-errors" not in dom.els[body]["attrs"], dom.els[body]["attrs"].get("data-errors")
    assert not _console_errors(log), _console_errors(log)
    # nothing refers outside the page (matplotlib's SVGs link their own clip paths and glyphs by #id)
    for e in dom.els:
        for k in ("src", "href", "xlink:href"):
            assert e["attrs"].get(k) is None or e["attrs"][k].startswith("#"), (e["tag"], k, e["attrs"][k])

    # the tables: both paired CIs where two seeds were pooled
    table = dom.one("table", id="comparisons-table")
    row = next(i for i in dom.find("tr", under=table) if dom.text(i).startswith("prorag_vs_sft"))
    cells = [dom.text(i) for i in dom.find("td", under=row)]
    assert cells[-2] == "2" and cells[5].startswith("[") and cells[6].startswith("[")  # seeds; CI; seeds+questions CI
    assert "prorag[beta=0.5]" in dom.text(dom.one("table", id="methods-table"))
    # the claim, link by link: the chain's four links, each with a status
    claim = dom.one("table", id="claim-table")
    links = [[dom.text(i) for i in dom.find("td", under=r)] for r in dom.find("tr", under=claim)]
    links = [cells for cells in links if cells]
    assert [cells[0] for cells in links][0] == "RL learns" and len(links) == 4
    assert all(cells[-1] in ("holds", "not shown", "reversed", "fails", "not run") for cells in links)

    # every picture, as an inline SVG: the Markdown report's plots and each trainer job's curves
    plots = {dom.els[i]["attrs"]["data-plot"]: i for i in dom.find("figure", cls="plot")}
    expected = {"f1_by_hops", "beta", "data_efficiency", "rl_curves", "job:w1-sft-1", "job:w1-prm-1",
                "job:w1-rl-prorag-1", "job:w1-rl-outcome-1"}
    assert set(plots) == expected
    for name, i in plots.items():
        assert len(dom.find("svg", under=i)) == 1, name
    rl_panels = dom.text(plots["job:w1-rl-prorag-1"])
    for title in ("loss", "learning rate", "tokens/s", "rollout reward", "groups with no signal", "KL",
                  "clip fraction"):
        assert title in rl_panels, title
    sft_panels = dom.text(plots["job:w1-sft-1"])
    assert "learning rate" in sft_panels and "rollout reward" not in sft_panels
    mcts = dom.one("section", data_job="w1-mcts-1")
    assert not dom.find("svg", under=mcts) and "No training curve" in dom.text(mcts)

    # the trajectory browser, filled in by the script: every question listed, the first one shown
    assert len(dom.find("li", under=dom.one("ul", id="traj-list"))) == N
    view = dom.one("div", id="traj-view")
    shown = dom.one("div", cls="question", under=view)
    assert dom.els[shown]["attrs"]["data-id"] == "q0"
    methods = {dom.els[i]["attrs"]["data-method"]: i for i in dom.find("div", cls="method", under=view)}
    assert set(methods) == {"sft", "outcome_grpo", "prorag", "outcome_grpo@it3", "prorag@it3", "standard_rag",
                            "no_retrieval"}
    steps = dom.find("li", cls="step", under=methods["sft"])  # q0: 1 hop, walked right
    assert [c for i in steps for c in dom.cls(i) if c.startswith(("kind-", "verdict-"))] == [
        "kind-subquery", "verdict-sound", "kind-subanswer", "verdict-sound", "kind-answer", "verdict-sound"]
    docs = dom.one("details", cls="docs", under=steps[0])
    assert "The Harbour is linked to Harbour 1." in dom.text(docs)
    # baselines saved no documents' text: coloured by kind, no verdict, their retrieved ids folded
    rag = methods["standard_rag"]
    assert all(not any(c.startswith("verdict-") for c in dom.cls(i)) for i in dom.find("li", cls="step", under=rag))
    assert "d0_0" in dom.text(rag)

    # the tree viewer: the first tree's every node, the judged pair's verdict on its two siblings
    tree = dom.one("ul", cls="tree", under=dom.one("div", id="tree-view"))
    assert len(dom.find("li", cls="node", under=tree)) == runs["tree_nodes"]
    assert len(dom.find("option", under=dom.one("select", id="tree-select"))) == 2
    subqueries = [i for i in dom.find("li", cls="node", under=tree) if dom.els[i]["attrs"]["data-kind"] == "subquery"]
    badges = [" ".join(dom.text(b) for b in dom.find("span", cls="badge", under=i)
                       if {"b-chosen", "b-rejected"} & set(dom.cls(b))) for i in subqueries]
    assert "judge \u2713" in badges[0] and "value \u2713" in badges[0]
    assert "judge \u2717" in badges[-1] and "value \u2717" in badges[-1]
    assert "wrong entity" in dom.text(dom.one("details", cls="pairs", under=tree))

    # the search box: a URL fragment fills it; the list and the view follow
    dom, log = _render(index, tmp_path, "#q=" + "juniper")
    assert not _console_errors(log) and "data-errors" not in dom.els[dom.one("body")]["attrs"]
    listed = dom.find("li", under=dom.one("ul", id="traj-list"))
    assert [dom.els[i]["attrs"]["data-id"] for i in listed] == ["q8"]
    assert dom.text(dom.one("span", id="traj-count")).startswith("1 of 12")
    view = dom.one("div", id="traj-view")
    sft = dom.one("div", cls="method", under=view, data_method="sft")  # q8 (i % 2 == 0): right
    grpo = dom.one("div", cls="method", under=view, data_method="outcome_grpo")  # q8 (8 % 3 == 2): right
    assert "verdict-unsound" not in " ".join(" ".join(dom.cls(i)) for i in dom.find("li", under=sft))
    assert len(dom.find("li", cls="verdict-sound", under=grpo)) == 3  # q8's one hop: every step sound
    dom, _ = _render(index, tmp_path, "#q=thistle")  # q5: sft searched a wrong entity
    first = dom.find("li", cls="step", under=dom.one("div", cls="method", data_method="sft"))[0]
    assert "verdict-unsound" in dom.cls(first) and "wrong entity" in dom.text(first)
    dom, _ = _render(index, tmp_path, "#q=no+such+question")
    assert "No question matches." in dom.text(dom.one("div", id="traj-view"))


def test_large_runs_are_capped_and_the_page_says_so(runs, tmp_path, monkeypatch):
    from prorag_app import report_html
    from prorag_app.report import build_report

    monkeypatch.setattr(report_html, "MAX_QUESTIONS", 5)
    monkeypatch.setattr(report_html, "MAX_TREES", 1)
    monkeypatch.setattr(report_html, "MAX_TREE_NODES", 2)
    report = build_report(runs["dirs"][:1], tmp_path / "out", tmp_path / "html")
    assert report["html"] == str(tmp_path / "html" / "index.html")
    page = (tmp_path / "html" / "index.html").read_text()
    assert "5 of the first run's 12 evaluated questions (test split; the first 5, the page's cap)" in page
    assert "1 of the 2 trees" in page and "at most 2 nodes per tree" in page and "1 tree(s) cut" in page
    data = json.loads(page.split('id=report-data>', 1)[1].split("</script>", 1)[0])
    assert [q["id"] for q in data["trajectories"]["questions"]] == [f"q{i}" for i in range(5)]
    tree = data["trees"]["trees"][0]
    assert tree["nodes"] == 2 and tree["root"]["more"] == 1 and tree["unmatched_pairs"] == 1
