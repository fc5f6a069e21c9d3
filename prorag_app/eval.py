"""`prorag eval`: a policy (any model or adapter version) over a split, through the services.

Methods: ``agent`` (ProRAG step format, server-side rollouts with live retrieval; used for sft,
rft, rl...), ``no_retrieval`` (question -> answer), ``standard_rag`` (the question's top-k
documents, then the answer) and ``single_search`` (an agent's model held to one search made with the
question). Every prediction and trajectory is saved; scores are EM/F1 with
95% bootstrap CIs overall, per hop count and per question type.

`prorag eval prm` (:func:`eval_prm`): a published PRM on gold steps against corrupted ones, per corruption
family, in-distribution and held out (prorag.prm.evaluation), with the gate before PRM-guided stages.
"""

from __future__ import annotations

import inspect
import json
import re
from functools import partial
from pathlib import Path
from typing import Iterable

from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table

from prorag import paths
from prorag.data.loaders import load_corpus, load_split
from prorag.data.sft import (agent_prompt, agent_steps, baseline_prompt, content_prefix_ids, encode_segments,
                              single_search_thoughts)
from prorag.data.world import canonical_question
from prorag.errors import FailedPrecondition
from prorag.evaluation import MULTI_HOP_MIN, names_entity, question_entity, score_records
from prorag.io import write_json, write_jsonl
from prorag.methods import AGENT_MAX_STEPS, DOCS_PER_SEARCH, kind_of
from prorag.metrics import qa_scores
from prorag.pb import common_pb2
from prorag.prm.evaluation import (CORRUPTIONS, FAMILIES, HELD_OUT, auc_by_kind, centred_per_kind, prm_gate,
                                   validation_cases)
from prorag.registry import MANIFEST, Manifest, registry
from prorag.rpc.clients import call_with_service_wait
from prorag.runs import new_run_dir, point_latest
from prorag.trajectory import (ANSWER_END, ANY_TAG, IM_END, STOP_TAGS, SUBANSWER_END, TAGS, Step, extract_answer,
                               parse_step)



def _record(q, prediction: str | None, extra: dict) -> dict:
    s = qa_scores(prediction or "", q.golden_answers)
    return {"id": q.id, "question": q.question, "golden_answers": q.golden_answers, "prediction": prediction,
            "hops": q.hops, "type": q.qtype, **s, **extra}


#: how long an evaluation waits for a policy that went away, or whose retriever did (the policy answers UNAVAILABLE),
#: before it stops; what it finished is kept either way
EVAL_SERVICE_WAIT_S = 600.0


def run_agent(policy, questions, *, max_steps: int = AGENT_MAX_STEPS, topk: int = DOCS_PER_SEARCH, adapter: str = "",
              chunk: int = 128, progress=None, service_wait_s: float = EVAL_SERVICE_WAIT_S) -> list[dict]:
    """Greedy rollouts through the policy service (which calls the retriever); each record also says whether
    the first step was a subquery naming the question's entity (the first hop's document title).

    A chunk whose rollouts fail for a service that is away or overloaded (UNAVAILABLE, DEADLINE_EXCEEDED: a
    starved retriever on a busy machine) is made again once the service answers (call_with_service_wait); greedy
    decoding makes the retried chunk's answers the same."""
    by_id = {q.id: q for q in questions}
    records = []
    for i in range(0, len(questions), chunk):
        part = questions[i:i + chunk]
        request = partial(_rollout_chunk, policy, [(q.id, q.question) for q in part], max_steps, topk, adapter)
        for t in call_with_service_wait(request, policy.target, "policy", service_wait_s):
            if not hasattr(t, "question_id"):
                continue  # the summary
            q = by_id[t.question_id]
            traj = MessageToDict(t, preserving_proto_field_name=True)
            traj.pop("trace", None)  # token ids are large; the text and steps are kept
            first = t.steps[0] if t.steps else None
            first_subquery = first.content if first is not None and first.kind == common_pb2.STEP_KIND_SUBQUERY else ""
            records.append(_record(q, t.answer if t.finish_reason == "answer" else None,
                                   {"finish_reason": t.finish_reason, "format_valid": t.format_valid,
                                    "adapter_version": t.adapter_version, "trajectory": traj,
                                    "first_subquery_entity": names_entity(first_subquery, question_entity(q))}))
            if progress:
                progress(len(records), len(questions))
    return records


def _rollout_chunk(policy, questions: list[tuple[str, str]], max_steps: int, topk: int, adapter: str) -> list:
    """One chunk's greedy rollouts, the stream read whole (a retry makes the whole request again)."""
    return list(policy.rollout(questions, policy.sampling(n=1, temperature=0.0), max_steps=max_steps, topk=topk,
                               adapter=adapter))


def run_baseline(policy, retriever, questions, mode: str, *, topk: int = DOCS_PER_SEARCH, chunk: int = 256,
                 max_tokens: int = 96, progress=None) -> list[dict]:
    """One answer step per question; standard RAG first retrieves the question's top-k documents."""
    records = []
    for i in range(0, len(questions), chunk):
        part = questions[i:i + chunk]
        docs = [None] * len(part)
        if mode == "standard_rag":
            docs = retriever.search([q.question for q in part], topk=topk, timeout=600)
        prompts = [baseline_prompt(q.question, d) for q, d in zip(part, docs)]
        resp = policy.generate_steps(prompts, policy.sampling(n=1, temperature=0.0, max_tokens=max_tokens,
                                                              stop=[ANSWER_END, IM_END]))
        for q, d, res in zip(part, docs, resp.results):
            text = res.completions[0].text
            step = parse_step(text)
            answer = step.content if step.kind == "answer" else extract_answer(text)
            records.append(_record(q, answer, {"generated": text, "format_valid": step.kind == "answer",
                                               "retrieved_ids": [x.id for x in d] if d else [],
                                               "adapter_version": resp.adapter_version}))
        if progress:
            progress(len(records), len(questions))
    return records


def run_single_search(policy, retriever, questions, *, tokenizer_dir: str, topk: int = DOCS_PER_SEARCH,
                      restate_question: bool = False, plan_thoughts: bool = False, chunk: int = 256,
                      max_tokens: int = 64, adapter: str = "", progress=None) -> list[dict]:
    """Standard RAG read by an agent's model: one search, made with the question itself, and the model's
    reading of its top-k documents, in the agent's own step format. Greedy, two batched rounds through
    ``generate_steps``.

    Each question is written as the agent's trajectory of a 1-hop question whose sub-question is the question
    (:func:`prorag.data.sft.single_search_thoughts`, with the thought settings the model was trained with), and
    the model writes only what standard RAG's reader writes: (1) the subanswer it reads out of the documents,
    (2) the final answer. Why the format is written for it: the comparison is about searching, not about
    whether a model trained to search step by step plans a one-search trajectory on its own. Prefixes are
    token ids cut as training tokenised the steps (:func:`prorag.data.sft.content_prefix_ids`; the tokenizer of
    ``tokenizer_dir``, the served model's). ``format_valid``: the model closed both with their own tags.
    """
    from transformers import AutoTokenizer  # heavy; the baselines and the agent never need it

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sampling = policy.sampling(n=1, temperature=0.0, max_tokens=max_tokens, stop=list(STOP_TAGS))
    records = []
    for i in range(0, len(questions), chunk):
        part = questions[i:i + chunk]
        docs = retriever.search([q.question for q in part], topk=topk, timeout=600)
        steps = []
        for q, d in zip(part, docs):
            search, read, final = single_search_thoughts(q.id, q.question, restate=restate_question,
                                                         plan=plan_thoughts)
            steps.append([Step("subquery", thought=search, content=q.question, docs=list(d)[:topk]),
                          Step("subanswer", thought=read), Step("answer", thought=final)])
        closed = [True] * len(part)
        for n_steps, closing in ((2, SUBANSWER_END), (3, ANSWER_END)):
            prefixes = [content_prefix_ids(tokenizer, agent_prompt(q.question), s[:n_steps])
                        for q, s in zip(part, steps)]
            resp = policy.generate_steps(prefixes, sampling, adapter=adapter)
            for k, res in enumerate(resp.results):
                text = res.completions[0].text
                first_tag = ANY_TAG.search(text)
                closed[k] = closed[k] and first_tag is not None and first_tag.group() == closing
                s = steps[k][n_steps - 1]
                steps[k][n_steps - 1] = Step(s.kind, thought=s.thought,
                                             content=ANY_TAG.split(text, maxsplit=1)[0].strip())
        for k, q in enumerate(part):
            answer = steps[k][2].content
            records.append(_record(q, answer or None, {
                "format_valid": closed[k] and all(s.content for s in steps[k]),
                "retrieved_ids": [x.id for x in steps[k][0].docs],
                "steps": [{"kind": s.kind, "thought": s.thought, "content": s.content} for s in steps[k]],
                "adapter_version": resp.adapter_version}))
        if progress:
            progress(len(records), len(questions))
    return records


def reader_settings(method: str, model_dir: str, trained: dict) -> dict:
    """Evaluation settings that follow from the evaluated model (``model_dir``, its manifest's config
    ``trained``): a single-search method writes the thoughts the model was trained to write, in its tokens."""
    if kind_of(method) == "single_search":
        return {"plan_thoughts": bool(trained.get("plan_thoughts", False)),
                "restate_question": bool(trained.get("restate_question", False)), "tokenizer_dir": str(model_dir)}
    return {}


def save_records(path: Path, records: Iterable[dict]) -> None:
    write_jsonl(path, records)


def evaluate(method: str, policy, retriever, questions, out_dir: Path | None = None, **kw) -> dict:
    kind = kind_of(method)
    if kind == "agent":
        records = run_agent(policy, questions, **kw)
    elif kind == "single_search":
        kw.pop("max_steps", None)  # one search by definition
        records = run_single_search(policy, retriever, questions, **kw)
    else:
        records = run_baseline(policy, retriever, questions, kind, **kw)
    result = score_records(records)
    result["format_valid_rate"] = sum(bool(r.get("format_valid")) for r in records) / len(records)
    if kind == "agent":
        result["first_subquery_entity_rate"] = sum(r["first_subquery_entity"] for r in records) / len(records)
    if out_dir is not None:
        save_records(Path(out_dir) / method / "predictions.jsonl", records)
        write_json(Path(out_dir) / method / "scores.json", result)
    return result


def format_table(methods: dict[str, dict], split: str = "test") -> "object":
    """A rich Table: F1 [95% CI] per hop count and type, one row per method."""
    cols = sorted({h for m in methods.values() for h in m["by_hops"]}, key=lambda h: int(h))
    types = sorted({t for m in methods.values() for t in m["by_type"]} - {"compositional"})
    table = Table(title=f"{split.capitalize()} split: F1 (x100) [95% bootstrap CI]; EM and acc (FlashRAG acc = "
                        "Search-R1 subem) overall")
    table.add_column("method")
    table.add_column("EM", justify="right")
    table.add_column("acc", justify="right")
    table.add_column("F1 overall", justify="right")
    for h in cols:
        table.add_column(f"{h}-hop", justify="right")
    table.add_column(f"{MULTI_HOP_MIN}+ hops", justify="right")
    for t in types:
        table.add_column(t, justify="right")

    def cell(m):
        if not m:
            return "-"
        return f"{100 * m['f1']:.1f} [{100 * m['f1_ci'][0]:.1f},{100 * m['f1_ci'][1]:.1f}]"

    for name, m in methods.items():
        acc = m["overall"].get("acc")
        table.add_row(name, f"{100 * m['overall']['em']:.1f}", "-" if acc is None else f"{100 * acc:.1f}",
                      cell(m["overall"]),
                      *[cell(m["by_hops"].get(h)) for h in cols], cell(m.get("multi_hop")),
                      *[cell(m["by_type"].get(t)) for t in types])
    return table


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)


# ---------------------------------------------------------------- `prorag eval prm`
def score_cases(prm_dir: str, cases) -> tuple[list[float], list[float], str]:
    """(gold scores [N], corrupted scores [N], the PRM's version) of ``cases`` [N] (prorag.prm.evaluation.ProbeCase):
    each step scored after its case's context by the PRM of ``prm_dir`` in process, in batched passes."""
    from services.prm.engine import PRMEngine, ScoringItem  # torch, for the PRM in process only

    engine = PRMEngine(prm_dir)
    items = [ScoringItem(c.question, [*c.context, step], last_step_only=True) for c in cases
             for step in (c.gold, c.corrupted)]
    scored: list[float] = []
    for i in range(0, len(items), 256):
        scored += [s[0] for _, s in engine.score(items[i:i + 256])]
    return scored[0::2], scored[1::2], engine.version


#: cases whose two renderings share one padded pass in likelihood_cases: its two steps are of about one length, while
#: cases of different trajectories pad to the longest (16 cases a pass took 72 s where 1 took 57 s on 857 cases, 2 CPU
#: cores)
CASES_PER_PASS = 1


def likelihood_cases(policy_dir: str, cases) -> tuple[list[float], list[float]]:
    """(gold [N], corrupted [N]) log-likelihoods of ``cases`` [N] (prorag.prm.evaluation.ProbeCase) under the policy
    of ``policy_dir``: for each of a case's two steps after its context, the sum of log p(token) over the tokens the
    policy writes (documents the environment inserts left out), from the first token where the two renderings part.
    The reference a PRM is read against: how far the policy itself already prefers the sound step."""
    import torch  # heavy: only for this reference
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    tag_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def written_logliks(trajs: list, starts: list[int]) -> list[float]:
        # one padded pass for many sequences; right padding leaves a causal model's earlier positions as they are
        T = max(len(t.token_ids) for t in trajs)
        ids = torch.full((len(trajs), T), pad, dtype=torch.long)
        mask = torch.zeros((len(trajs), T), dtype=torch.long)
        for i, t in enumerate(trajs):
            ids[i, :len(t.token_ids)] = torch.tensor(t.token_ids)
            mask[i, :len(t.token_ids)] = 1
        # counted[i, t - 1]: token t of sequence i is written by the policy and lies past where the two steps part
        counted = torch.zeros((len(trajs), T - 1), dtype=torch.bool)
        for i, (t, start) in enumerate(zip(trajs, starts)):
            for p in range(max(start, 1), t.spans[-1].end):
                counted[i, p - 1] = bool(t.generated_mask[p])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            picked = torch.log_softmax(logits[counted].float(), -1)  # [K, V]: only the counted positions
            token_logp = picked.gather(1, ids[:, 1:][counted][:, None])[:, 0]  # [K]
        rows = torch.arange(len(trajs))[:, None].expand(-1, T - 1)[counted]
        return torch.zeros(len(trajs)).index_add_(0, rows, token_logp).tolist()

    gold, bad = [], []
    for i in range(0, len(cases), CASES_PER_PASS):
        trajs, starts = [], []
        for c in cases[i:i + CASES_PER_PASS]:
            pair = [encode_segments(tokenizer, agent_prompt(c.question), [*c.context, step], tag_ids, {})
                    for step in (c.gold, c.corrupted)]
            a, b = pair[0].token_ids, pair[1].token_ids
            start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            trajs += pair
            starts += [start, start]
        scores = written_logliks(trajs, starts)
        gold += scores[0::2]
        bad += scores[1::2]
    return gold, bad


def gold_trajectories(questions, docs_by_id: dict, sft_settings: dict) -> list[list]:
    """Each question's gold step-by-step trajectory, written as the SFT agent was trained to write it (its
    restated questions, plans and subquery phrasing), one gold document per search."""
    phrasing = canonical_question if sft_settings.get("canonical_subqueries") else None
    return [agent_steps(q, {}, docs_by_id, topk=1, restate=bool(sft_settings.get("restate_question")),
                        plan=bool(sft_settings.get("plan_thoughts")), phrasing=phrasing) for q in questions]


def validate_prm_families(prm_dir: str, questions, docs_by_id: dict, sft_settings: dict, seed: int = 0,
                          png: Path | None = None, families=None, trajectories=None,
                          reference_policy: str = "") -> dict:
    """The PRM of ``prm_dir`` on gold (or given correct) steps against corrupted ones, in-distribution and
    held-out families (prorag.prm.evaluation.validation_cases): auc_by_kind's report, plus ``questions``, ``version``,
    ``dropped`` (per family, cases that were no contrast) and ``png`` when one is drawn.

    trajectories: one correct trajectory (list of Steps) per question, e.g. the agent's own; None = each
    question's gold trajectory written as the SFT agent was trained to write it (``sft_settings``).
    reference_policy: a policy directory whose own likelihood of each step is scored on the same cases
    (:func:`likelihood_cases`), reported as ``reference``: AUC per family and pooled."""
    if trajectories is None:
        questions = [q for q in questions if any(s.doc_id for s in q.decomposition)
                     and all(s.doc_id in docs_by_id for s in q.decomposition if s.doc_id)]
        trajectories = gold_trajectories(questions, docs_by_id, sft_settings)
    cases, dropped = validation_cases(questions, trajectories, seed=seed, families=families or FAMILIES)
    if not cases:
        raise FailedPrecondition(f"no validation case from {len(questions)} questions: the PRM is validated on "
                                 "questions with a gold decomposition whose documents are in the corpus")
    gold, bad, version = score_cases(prm_dir, cases)
    out = auc_by_kind(cases, gold, bad)
    centred_gold, centred_bad, means = centred_per_kind(cases, gold, bad)
    centred = auc_by_kind(cases, centred_gold, centred_bad)
    out.update(questions=len(questions), version=version, dropped=dropped,
               centred={"overall": centred["overall"], "by_kind": centred["by_kind"], "kind_means": means})
    if reference_policy:
        ref = auc_by_kind(cases, *likelihood_cases(reference_policy, cases))
        out["reference"] = {"policy": reference_policy, "score": "log-likelihood of the written tokens",
                            **{k: ref[k] for k in ("overall", "by_kind", "n", "in_distribution", "held_out")}}
    if png is not None:
        plot_family_scores(cases, gold, bad, out, png)
        out["png"] = str(png)
    return out


def plot_family_scores(cases, gold, bad, report: dict, png: Path) -> None:
    """Histograms of gold against corrupted scores per family: in-distribution families on the first row,
    held-out ones on the second."""
    import matplotlib  # heavy, and needed for this one plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [[k for k in group if k in report["by_kind"]] for group in (CORRUPTIONS, HELD_OUT)]
    rows = [r for r in rows if r]
    width = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), width, figsize=(3.6 * width, 3.0 * len(rows)), squeeze=False)
    for r, kinds in enumerate(rows):
        for c in range(width):
            ax = axes[r][c]
            if c >= len(kinds):
                ax.axis("off")
                continue
            kind = kinds[c]
            idx = [i for i, x in enumerate(cases) if x.kind == kind]
            ax.hist([gold[i] for i in idx], bins=30, alpha=0.6, label="gold step")
            ax.hist([bad[i] for i in idx], bins=30, alpha=0.6, label="corrupted")
            ax.set_title(f"{kind}\nAUC {report['by_kind'][kind]['auc']:.3f} (n={len(idx)})", fontsize=9)
            ax.set_xlabel("PRM score")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)


def gate_verdict(auc_report: dict, **thresholds) -> dict:
    """results.json's ``gate``: prorag.prm.evaluation.prm_gate's verdict with the thresholds it applied."""
    passed, reasons = prm_gate(auc_report, **thresholds)
    applied = {name: p.default for name, p in inspect.signature(prm_gate).parameters.items()
               if p.default is not inspect.Parameter.empty}
    applied.update(thresholds)
    applied["unsupported_families"] = list(applied["unsupported_families"])
    # the figures it read, so a reader of a passed gate sees them too (a failed one names them in its reasons)
    by_kind = auc_report.get("by_kind") or {}
    figures = {"overall": auc_report.get("overall"),
               **{f: (by_kind.get(f) or {}).get("auc") for f in applied["unsupported_families"]}}
    return {"passed": passed, "reasons": reasons, **applied, "figures": figures}


def prm_results(validation: dict, job_metrics: dict) -> dict:
    """results.json's ``prm`` figures, shared by `prorag eval prm` and stage 2: the validation's AUCs per family
    (raw, and centred per step kind as the process advantage reads them), the policy's own likelihood on the same
    cases, the gate's verdict, and the PRM job's held-out pairwise accuracies (``job_metrics``: its manifest's or
    job's metrics). The caller adds where the figures come from (model, split, jobs)."""
    return {
        "auc_gold_vs_corrupted": {k: validation[k] for k in ("overall", "by_kind", "n", "in_distribution", "held_out")
                                  if k in validation},
        # additive: the same with scores centred per step kind (a diagnostic: the gate reads the raw scores)
        "auc_centred_per_kind": validation.get("centred"),
        # additive: the SFT policy's own log-likelihood of each step on the same cases
        "reference_policy_likelihood": validation.get("reference"),
        # additive: whether this PRM may guide stages 3-4 (prorag.prm.evaluation.prm_gate), and what was left out
        "gate": gate_verdict(validation),
        "cases_dropped": validation.get("dropped"),
        "pairwise_accuracy": job_metrics.get("heldout_pairwise_accuracy"),
        "pairwise_accuracy_by_kind": {k.split(".", 1)[1]: v for k, v in job_metrics.items()
                                      if k.startswith("heldout_pairwise_accuracy.")},
        # additive: the SFT policy's own likelihood on the PRM's held-out pairs (absent for an untied policy)
        "pairwise_accuracy_policy_likelihood": job_metrics.get("heldout_policy_likelihood_accuracy"),
        "png": validation["png"],
    }


def gate_line(gate: dict, mode: str) -> str:
    """One line for a run's output: the PRM gate's verdict, the AUCs it read, and what the verdict decided."""
    figures = ", ".join(f"{k} {v:.3f}" if isinstance(v, (int, float)) else f"{k} -"
                        for k, v in (gate.get("figures") or {}).items())
    verdict = "passed" if gate.get("passed") else "NOT passed (" + "; ".join(gate.get("reasons") or []) + ")"
    decided = ("the PRM-guided arms ran all the same (prm_gate: report)" if mode == "report"
               else "a PRM below it guides nothing (prm_gate: enforce)")
    return f"PRM gate on dev: {verdict}" + (f"; AUC {figures}" if figures else "") + f"; {decided}"


def print_prm_families(prm: dict) -> None:
    """The validation table: AUC and cases per family with its group, the pooled groups, and the gate."""
    auc = prm["auc_gold_vs_corrupted"]
    centred = prm.get("auc_centred_per_kind") or {}
    split = prm.get("split", prm.get("validation_split", "test"))  # eval prm's key, and stage 2's
    table = Table(title=f"PRM validation: gold steps against corrupted ones ({split} split)")
    ref = prm.get("reference_policy_likelihood") or {}
    for col in ("family", "group", "AUC", "centred per kind", *(("policy likelihood",) if ref else ()), "cases"):
        table.add_column(col, justify="left" if col in ("family", "group") else "right")

    def shown(v) -> str:
        return "-" if v is None else f"{v:.3f}"

    for kind, v in auc["by_kind"].items():
        table.add_row(kind, "held out" if kind in HELD_OUT else "in distribution", shown(v["auc"]),
                      shown((centred.get("by_kind") or {}).get(kind, {}).get("auc")),
                      *((shown((ref.get("by_kind") or {}).get(kind, {}).get("auc")),) if ref else ()), str(v["n"]))
    for group in ("in_distribution", "held_out"):
        v = auc.get(group) or {}
        table.add_row(f"[b]{group.replace('_', ' ')}[/b]", "pooled", shown(v.get("auc")), "",
                      *((shown((ref.get(group) or {}).get("auc")),) if ref else ()), str(v.get("n", 0)))
    table.add_row("[b]overall[/b]", "every family", shown(auc["overall"]), shown(centred.get("overall")),
                  *((shown(ref.get("overall")),) if ref else ()), str(auc["n"]))
    console = Console()
    console.print(table)
    pa = prm.get("pairwise_accuracy")
    by_kind = prm.get("pairwise_accuracy_by_kind") or {}
    ref_pa = prm.get("pairwise_accuracy_policy_likelihood")
    console.print((f"held-out pairwise accuracy: {pa:.3f}" if pa is not None else "held-out pairwise accuracy: -")
                  + ("" if not by_kind else " (" + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_kind.items()))
                                                + ")")
                  + ("" if ref_pa is None else f"; the SFT policy's own likelihood: {ref_pa:.3f}"))
    gate = prm.get("gate")
    if gate:
        console.print(f"gate for PRM-guided stages (unsupported sub-answer AUC >= {gate['min_unsupported']}, "
                      f"overall >= {gate['min_overall']}): " + ("[green]passed[/green]" if gate["passed"] else
                                                               "[red]not passed[/red]"))
        for reason in gate["reasons"]:
            console.print(f"  - {reason}")


def eval_prm(args) -> int:
    """`prorag eval prm`: a published PRM on gold steps against corrupted ones of a split (``--split dev`` where
    settings are chosen), every corruption family (prorag.prm.evaluation), AUC per family and pooled, the gate's
    verdict and a PNG; results.json's ``prm``."""
    from prorag_app.profiles import PROFILES  # the profiles import torch when they check their settings

    prm_dir = registry("prm", args.world).resolve(args.model or "prm")
    world_dir = paths.world_dir(args.world)
    qs = load_split(world_dir, args.split)
    qs = qs[:args.limit] if args.limit else qs
    docs = {d.id: d for d in load_corpus(world_dir / "corpus.jsonl")}
    out = Path(args.out) if args.out else new_run_dir("eval-prm")
    reference = str(registry("model", args.world).resolve(args.reference_policy)) if args.reference_policy else ""
    validation = validate_prm_families(str(prm_dir), qs, docs, PROFILES[args.profile].sft_for("sft"),
                                       seed=args.seed, png=out / "prm" / "scores.png", reference_policy=reference)
    manifest = prm_dir / MANIFEST
    metrics = Manifest.read(manifest).metrics if manifest.is_file() else {}
    prm = {"model": validation["version"], "split": args.split, "questions": validation["questions"],
           **prm_results(validation, metrics)}
    write_json(out / "results.json", {"prm": prm})
    if not args.out:
        point_latest(out)
    print_prm_families(prm)
    print(json.dumps({"prm": prm}))
    return 0
