"""What `prorag run` prints besides its progress: retrieval recall, the diagnostics, the stage 3-4 tables and the
multi-hop figure's line."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from prorag.evaluation import COMPARISON_MIN_HOPS

from prorag_app.eval import format_table, gate_line
from prorag_app.stage34 import print_comparisons, print_rl

console = Console()


def print_retrieval_table(results: dict, ks: tuple[int, ...]) -> None:
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


def print_answer_errors(errors: dict[str, dict], min_hops: int = COMPARISON_MIN_HOPS) -> None:
    """Why each model's answers are wrong (prorag_app.report.error_counts' {method: {"n", "counts"}}), % of them."""
    if not errors:
        return
    kinds = list(next(iter(errors.values()))["counts"])
    table = Table(title=f"Why answers are wrong, questions of {min_hops}+ hops (% of them; `prorag diagnose errors`)")
    for col in ("model", "n", *kinds):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m, row in errors.items():
        table.add_row(m, str(row["n"]), *(f"{100 * row['counts'][k] / max(row['n'], 1):.1f}" for k in kinds))
    console.print(table)


def print_stage34(methods: dict, stage34: dict, comparisons: dict, split: str) -> None:
    """Every method's scores again with the stage 3-4 ones, their RL runs, their paired comparisons and what
    was skipped."""
    console.print(format_table(methods, split))
    print_rl(stage34["rl"])
    print_comparisons(comparisons, split)
    if stage34.get("prm_gate"):
        console.print(gate_line(stage34["prm_gate"], (stage34.get("settings") or {}).get("prm_gate", "report")))
    for m, why in stage34["skipped"].items():
        console.print(f"[yellow]{m}: skipped: {why}[/yellow]")


def print_figure(figure: dict | None) -> None:
    """Issue #4's figure in one line (prorag_app.pipeline.multi_hop_figure); nothing without one."""
    if figure:
        console.print(f"{figure['group']}: sft - standard_rag = {100 * figure['margin']:+.1f} F1; CI widths "
                      f"{100 * figure['better_ci_width']:.1f} / {100 * figure['baseline_ci_width']:.1f}; "
                      f"figure {'reached' if figure['reached'] else 'NOT reached'}")
