"""Pure algorithm functions (losses, schedules; later rewards, advantages, MCTS, filters): tensors and numbers
in, tensors and numbers out, no I/O, shapes in docstrings. Selected by name from configuration: each module
keeps a name -> function table (``SCHEDULES``, ``LOSSES``, ...) that configs list as their choices."""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

from prorag.errors import InvalidArgument

F = TypeVar("F", bound=Callable)


def lookup(table: Mapping[str, F], kind: str, name: str) -> F:
    """``table[name]``; an unknown name -> InvalidArgument listing the known ones."""
    try:
        return table[name]
    except KeyError:
        raise InvalidArgument(f"unknown {kind} {name!r} (known: {', '.join(sorted(table))})") from None
