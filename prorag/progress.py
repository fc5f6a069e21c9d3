"""Progress bars for every long step: one callback shape, progress(stage, done, total)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

ProgressFn = Callable[[str, int, int], None]
console = Console(stderr=True)


@contextlib.contextmanager
def progress_bars(enabled: bool | None = None) -> Iterator[ProgressFn]:
    """Yield a progress(stage, done, total) callback rendering one rich bar per stage."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        last: dict[str, int] = {}

        def plain(stage: str, done: int, total: int) -> None:
            # Non-interactive (CI, logs): one line per ~10% so logs stay short.
            step = max(1, total // 10)
            if done == total or done - last.get(stage, -step) >= step:
                last[stage] = done
                console.print(f"[dim]{stage}: {done}/{total}[/dim]")

        yield plain
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as bars:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done, total=total)

        yield update
