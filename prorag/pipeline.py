"""`prorag run`: the main job on the embedded default.

Builds what is missing (world, indexes), starts the five services, and evaluates through
them. At this stage it measures retrieval quality on the test split (recall@k of the gold
supporting documents, per hop, for dense, BM25 and hybrid) and writes runs/latest/results.json.
"""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

from prorag import paths
from prorag.clients import RetrieverClient
from prorag.data.loaders import load_split
from prorag.embedded import ensure_indexes, ensure_policy_model
from prorag.evaluation import grouped_mean_ci, recall_at_k, retrieval_queries
from prorag.runs import code_version, new_run_dir, write_results
from prorag.stack import ServiceStack

PROFILES = {"tiny": {"world": "tiny"}, "default": {"world": "default"}}
KS = (1, 3, 5, 10)
INDEXES = ("dense", "bm25", "hybrid")

console = Console()


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
        table = Table(title=f"Retrieval recall@k on the test split: {title}")
        table.add_column("index")
        table.add_column("group")
        for k in ks:
            table.add_column(f"R@{k}", justify="right")
        table.add_column("n", justify="right")
        for index, res in results.items():
            cells = res[name]
            groups = list(cells[f"recall@{ks[0]}"].keys())
            for g in groups:
                row = [index, g] + [f"{cells[f'recall@{k}'][g]['mean']:.3f}" for k in ks]
                table.add_row(*row, str(cells[f"recall@{ks[0]}"][g]["n"]))
            table.add_section()
        console.print(table)


def run_main_job(profile: str = "default", world: str | None = None, port_offset: int = 0) -> dict:
    world = world or PROFILES[profile]["world"]
    timings = {}
    t0 = time.monotonic()
    ensure_indexes(world)
    ensure_policy_model(world)
    timings["build_world_and_indexes_s"] = time.monotonic() - t0
    run_dir = new_run_dir(f"run-{profile}")
    t1 = time.monotonic()
    with ServiceStack(port_offset=port_offset, world=world) as stack:
        timings["start_services_s"] = time.monotonic() - t1
        test = load_split(paths.world_dir(world), "test")
        t2 = time.monotonic()
        with RetrieverClient(stack.grpc_target("retriever")) as client:
            retrieval = evaluate_retrieval(client, test)
        timings["evaluate_retrieval_s"] = time.monotonic() - t2
    print_retrieval_table(retrieval)
    results = {
        "methods": {},
        "retrieval": retrieval,
        "profile": profile,
        "world": world,
        "code_version": code_version(),
        "timings": timings,
    }
    path = write_results(run_dir, results)
    console.print(f"results: {path} (runs/latest/results.json)")
    console.print(json.dumps({k: round(v, 2) for k, v in timings.items()}))
    return results
