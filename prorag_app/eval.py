"""`prorag eval`: a policy (any model or adapter version) over a split, through the services.

Methods: ``agent`` (ProRAG step format, server-side rollouts with live retrieval; used for sft,
rft, rl...), ``no_retrieval`` (question -> answer), ``standard_rag`` (the question's top-k
documents, then the answer) and ``single_search`` (an agent's model held to one search made with the
question). Every prediction and trajectory is saved; scores are EM/F1 with
95% bootstrap CIs overall, per hop count and per question type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from prorag.evaluation import MULTI_HOP_MIN, names_entity, question_entity, score_records
from prorag.methods import AGENT_MAX_STEPS, DOCS_PER_SEARCH, kind_of
from prorag.metrics import qa_scores
from prorag.trajectory import (ANSWER_END, ANY_TAG, IM_END, STOP_TAGS, SUBANSWER_END, Step, extract_answer,
                               parse_step)



def _record(q, prediction: str | None, extra: dict) -> dict:
    s = qa_scores(prediction or "", q.golden_answers)
    return {"id": q.id, "question": q.question, "golden_answers": q.golden_answers, "prediction": prediction,
            "hops": q.hops, "type": q.qtype, **s, **extra}


def run_agent(policy, questions, *, max_steps: int = AGENT_MAX_STEPS, topk: int = DOCS_PER_SEARCH, adapter: str = "",
              chunk: int = 128, progress=None) -> list[dict]:
    """Greedy rollouts through the policy service (which calls the retriever); each record also says whether
    the first step was a subquery naming the question's entity (the first hop's document title)."""
    from prorag.pb import common_pb2
    from google.protobuf.json_format import MessageToDict

    by_id = {q.id: q for q in questions}
    records = []
    for i in range(0, len(questions), chunk):
        part = questions[i:i + chunk]
        for t in policy.rollout([(q.id, q.question) for q in part], policy.sampling(n=1, temperature=0.0),
                                max_steps=max_steps, topk=topk, adapter=adapter):
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


def run_baseline(policy, retriever, questions, mode: str, *, topk: int = DOCS_PER_SEARCH, chunk: int = 256,
                 max_tokens: int = 96, progress=None) -> list[dict]:
    """One answer step per question; standard RAG first retrieves the question's top-k documents."""
    from prorag.sft_data import baseline_prompt

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
    (:func:`prorag.sft_data.single_search_thoughts`, with the thought settings the model was trained with), and
    the model writes only what standard RAG's reader writes: (1) the subanswer it reads out of the documents,
    (2) the final answer. Why the format is written for it: the comparison is about searching, not about
    whether a model trained to search step by step plans a one-search trajectory on its own. Prefixes are
    token ids cut as training tokenised the steps (:func:`prorag.sft_data.content_prefix_ids`; the tokenizer of
    ``tokenizer_dir``, the served model's). ``format_valid``: the model closed both with their own tags.
    """
    from transformers import AutoTokenizer

    from prorag.sft_data import agent_prompt, content_prefix_ids, single_search_thoughts

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
    from prorag.io import write_jsonl

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
        from prorag.io import write_json

        write_json(Path(out_dir) / method / "scores.json", result)
    return result


def format_table(methods: dict[str, dict], split: str = "test") -> "object":
    """A rich Table: F1 [95% CI] per hop count and type, one row per method."""
    from rich.table import Table

    cols = sorted({h for m in methods.values() for h in m["by_hops"]}, key=lambda h: int(h))
    types = sorted({t for m in methods.values() for t in m["by_type"]} - {"compositional"})
    table = Table(title=f"{split.capitalize()} split: F1 (x100) [95% bootstrap CI]; EM and acc (FlashRAG acc = Search-R1 subem) "
                        "overall")
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
