"""Strings that are not Unicode text, found in a parsed JSON (or YAML) value before they reach a tokenizer, an index
or a file name.

A JSON ``\\uXXXX`` escape can carry a lone UTF-16 surrogate (``"\\ud800"``) into a Python string, and Python's json
reads raw bytes with ``surrogatepass``, so UTF-8-encoded surrogates (CESU-8) arrive the same way. Such a string
cannot be encoded as UTF-8: a tokenizer, ``os.stat`` or a UTF-8 file then fail with an error that is no caller's
to read. Surrogates are the only code points a Python ``str`` holds that UTF-8 cannot encode, so a string is text
exactly when it holds none. An escaped pair (``"\\ud83d\\ude00"``) is decoded by json into one astral character and
passes.

:func:`invalid_string` finds the first offending string (an object's key or any value) and its JSON path
(``queries[0]``, ``messages[2].content``); :func:`check_strings` raises a caller's error naming it. Whatever reads
JSON a caller wrote calls one of them once, where the JSON enters (prorag.rpc.jsonbody for HTTP bodies and job
configs, prorag.config.from_dict for config files and mappings, the tokens file, the judge's replies)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY_SHOWN = 40  # characters of a long key shown in a path


def _step(parent: str, key: Any) -> str:
    """``parent`` and one more step: ``[3]`` for a list index, ``.name`` for a plain key, ``["odd key"]`` (JSON,
    ASCII-escaped, so the path itself is always printable text) for any other."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    key = str(key)
    if _NAME.match(key):
        return f"{parent}.{key}" if parent else key
    shown = json.dumps(key[:_KEY_SHOWN]) + ("..." if len(key) > _KEY_SHOWN else "")
    return f"{parent}[{shown}]"


def _why(s: str) -> str | None:
    m = _SURROGATE.search(s)
    if m is None:
        return None
    c = ord(m.group())
    kind = "high" if c < 0xDC00 else "low"
    return f"holds a lone {kind} surrogate U+{c:04X} at character {m.start()}, which is not Unicode text"


def invalid_string(value: Any) -> tuple[str, str] | None:
    """(JSON path, what is wrong) of the first string in ``value`` that is not Unicode text, in document order, an
    object's keys included; None when every string is text. Dicts, lists and tuples are walked (iteratively: any
    depth json accepted); other values are left alone. The root's path is ``""``."""
    stack: list[tuple[str, Any, bool]] = [("", value, False)]
    while stack:
        path, v, is_key = stack.pop()
        if isinstance(v, str):
            why = _why(v)
            if why:
                return (f"{path} (a key)" if is_key else path), why
        elif isinstance(v, dict):
            items = []
            for k, x in v.items():
                p = _step(path, k)
                items.append((p, k, True))
                items.append((p, x, False))
            stack.extend(reversed(items))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(_step(path, i), x, False) for i, x in enumerate(v)]))
    return None


def describe(what: str, path: str, why: str) -> str:
    """The message for an invalid string at ``path`` of ``what`` (a request body, config_json, a file)."""
    where = f"{what}: {path}" if path else what
    return f"{where} {why}; send UTF-8 text (escape a surrogate only as a high one followed by a low one)"


def check_strings(value: Any, what: str = "request body",
                  error: Callable[[str], Exception] | None = None) -> Any:
    """``value`` itself when every string in it is Unicode text; else raises ``error`` (default InvalidArgument:
    HTTP 400, INVALID_ARGUMENT) naming ``what`` and the JSON path of the first string that is not."""
    found = invalid_string(value)
    if found is not None:
        if error is None:
            from prorag.errors import InvalidArgument  # here: prorag.config imports this module, not grpc

            error = InvalidArgument
        raise error(describe(what, *found))
    return value


#: what a JSON document must contain for it to decode into a surrogate: one itself (raw, read with surrogatepass),
#: or the escape of one (``\uD800``-``\uDFFF``, either case); a document without either needs no walk
MAY_HOLD_SURROGATES = re.compile("[\ud800-\udfff]|\\\\u[dD][89a-fA-F]")

__all__ = ["MAY_HOLD_SURROGATES", "check_strings", "describe", "invalid_string"]
