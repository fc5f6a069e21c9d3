"""The one config system: dataclasses whose fields carry help text and bounds (TRL style).

``cfg_field(default, help=..., min=..., max=..., choices=...)`` declares a field;
``from_dict(Cls, mapping)`` builds a config strictly: an unknown key or an
out-of-range value raises :class:`ConfigError` naming the field, so a bad job or
service config is refused before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from prorag.jsontext import invalid_string

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"{field_path}: {message}")


def cfg_field(default: Any = dataclasses.MISSING, *, help: str, min: float | None = None,
              max: float | None = None, choices: tuple | None = None, factory: Any = None):
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _check(path: str, f: dataclasses.Field, value: Any) -> None:
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(path, f"must be one of {list(m['choices'])}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if m.get("min") is not None and value < m["min"]:
            raise ConfigError(path, f"must be >= {m['min']}, got {value!r}")
        if m.get("max") is not None and value > m["max"]:
            raise ConfigError(path, f"must be <= {m['max']}, got {value!r}")


def _coerce(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, _prefix=path + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(path, inner[0], value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        (arg, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(f"{path}[{i}]", arg, v) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(path, f"expected a number, got {value!r}") from None
        except OverflowError:  # an integer beyond any float (JSON integers are unbounded)
            raise ConfigError(path, f"expected a number, got an integer of {value.bit_length()} bits") from None
        if not math.isfinite(number):  # NaN would pass every min/max check
            raise ConfigError(path, f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(path, f"expected a string, got {type(value).__name__}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict | None, *, _prefix: str = "") -> T:
    """Build ``cls`` from a mapping; unknown keys and bad values raise ConfigError. A string in it that is not
    Unicode text (a lone surrogate, from a JSON or YAML escape) is refused first, naming its path."""
    data = dict(data or {})
    if not _prefix:
        found = invalid_string(data)
        if found is not None:
            raise ConfigError(found[0], f"{found[1]}; write it as UTF-8 text")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(_prefix + unknown[0], f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            value = _coerce(_prefix + name, hints[name], data[name])
            _check(_prefix + name, f, value)
            kwargs[name] = value
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def check_fields(cls: type, data: dict, *, prefix: str = "") -> None:
    """Check a partial mapping of ``cls``'s fields (keys known, values of the right type and in range) without
    building the object: for settings that are completed later (a run profile's share of a job config)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(prefix + unknown[0], f"unknown key (known: {', '.join(sorted(fields))})")
    for name, value in data.items():
        _check(prefix + name, fields[name], _coerce(prefix + name, hints[name], value))


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def override(obj: T, **changes: Any) -> T:
    """A copy with changes applied, validated like from_dict."""
    merged = {**to_dict(obj), **changes}
    return from_dict(type(obj), merged)


def load_file(cls: type[T], path: str | Path) -> T:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    return from_dict(cls, data)


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) for every field: used by `--help` texts and docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out.append((f.name, getattr(f.type, "__name__", str(f.type)), default, f.metadata.get("help", "")))
    return out
