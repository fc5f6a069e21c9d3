from dataclasses import dataclass

import pytest

from prorag.config import ConfigError, cfg_field, describe, from_dict, override


@dataclass
class Inner:
    lr: float = cfg_field(1e-3, help="learning rate", min=0.0, max=1.0)


@dataclass
class Outer:
    name: str = cfg_field("x", help="a name")
    steps: int = cfg_field(10, help="steps", min=1)
    mode: str = cfg_field("a", help="mode", choices=("a", "b"))
    flags: list[int] = cfg_field(help="flags", factory=list)
    inner: Inner = cfg_field(help="nested", factory=Inner)


def test_defaults_and_values():
    cfg = from_dict(Outer, {"steps": 5, "inner": {"lr": 0.5}, "flags": [1, 2]})
    assert cfg.steps == 5 and cfg.inner.lr == 0.5 and cfg.flags == [1, 2] and cfg.mode == "a"


@pytest.mark.parametrize("data, field_name, fragment", [
    ({"stepz": 3}, "stepz", "unknown key"),
    ({"steps": 0}, "steps", ">= 1"),
    ({"steps": "many"}, "steps", "integer"),
    ({"mode": "c"}, "mode", "one of"),
    ({"inner": {"lr": 2.0}}, "inner.lr", "<= 1.0"),
    ({"inner": {"beta": 1}}, "inner.beta", "unknown key"),
    ({"flags": [1, "x"]}, "flags[1]", "integer"),
    ({"steps": True}, "steps", "integer"),
])
def test_errors_name_the_field(data, field_name, fragment):
    with pytest.raises(ConfigError) as ei:
        from_dict(Outer, data)
    assert ei.value.field == field_name
    assert fragment in str(ei.value)
    assert str(ei.value).startswith(field_name + ":")


def test_override_validates():
    cfg = from_dict(Outer, {})
    assert override(cfg, steps=7).steps == 7
    with pytest.raises(ConfigError):
        override(cfg, steps=-1)


def test_describe_has_help():
    rows = {name: help_ for name, _, _, help_ in describe(Outer)}
    assert rows["steps"] == "steps" and rows["inner"] == "nested"
