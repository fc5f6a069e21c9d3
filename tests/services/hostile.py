"""Hypothesis strategies for hostile input (tests/services/test_hostile_input.py): any protobuf message filled from
its descriptor (empty, long and unicode strings, negative and enormous numbers, NaN and infinities, unknown enum
values, repeated fields of 0..N, nested messages), and JSON bodies for the HTTP APIs (wrong types, malformed JSON,
strings that are not Unicode text: a lone surrogate, escaped or as raw bytes).

Protobuf strings are UTF-8, so the message strategies keep to text; JSON is not bound that way (a ``\\ud800`` escape
decodes into a lone surrogate), so its strategies also draw strings that are not text (issue 51).

Field hints steer a share of the values towards what the services know (an index name, a stage, a step in the
format), so that generated requests also get past the first check and reach the deeper ones."""

from __future__ import annotations

import json
import math

from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import strategies as st

INT32 = (-2 ** 31, 2 ** 31 - 1)
INT64 = (-2 ** 63, 2 ** 63 - 1)

#: characters that break naive code: NUL, controls, a lone surrogate's neighbours, RTL marks, emoji, CJK, BOM
ODD_CHARS = "\x00\x01\x7f\u0085\u2028\u200f\ufeff\U0001f600\u4e2d\u00e9\ufffd"


def text(max_size: int = 24) -> st.SearchStrategy[str]:
    """Empty, blank, unicode (no surrogates: protobuf strings are UTF-8), odd characters, and long strings (one
    character repeated: cheap to build and to send, longer than every per-field limit)."""
    return st.one_of(
        st.just(""),
        st.sampled_from([" ", "\n\t ", "\x00", ODD_CHARS, "@", "a@", "@b", "../../etc/passwd", "/", "%s%n{}"]),
        st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size),
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\U0001f600", " ", "a b "]),
                  st.sampled_from([300, 5_000, 70_000])),
    )


#: lone surrogates: the ends of the high and low ranges, the halves of a pair, a pair in the wrong order
SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\ude00", "\ude00\ud83d"]


def not_text(max_size: int = 24) -> st.SearchStrategy[str]:
    """Strings that are not Unicode text (JSON can carry them, protobuf cannot): a lone surrogate put into any string
    of :func:`text` (empty, unicode, long), or unicode with surrogates among its characters."""
    any_char = st.characters(exclude_categories=())
    return st.one_of(
        st.builds(lambda s, sur, at: s[:at] + sur + s[at:], text(max_size), st.sampled_from(SURROGATES),
                  st.integers(0, max_size)),
        st.builds(lambda s, sur: s + sur, st.text(any_char, max_size=max_size), st.sampled_from(SURROGATES)),
    )


def json_text(max_size: int = 24) -> st.SearchStrategy[str]:
    """A JSON string: any of :func:`text`, and now and then one that is not text."""
    return st.one_of(text(max_size), text(max_size), text(max_size), not_text(max_size))


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [0, 1, -1, 2, 3, lo, hi, lo + 1, hi - 1]
    if hi >= 2 ** 62:
        edges += [2 ** 62, -2 ** 62]
    return st.one_of(st.sampled_from([e for e in edges if lo <= e <= hi]), st.integers(lo, hi))


def floats(width: int) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, math.inf, -math.inf, math.nan]),
                     st.floats(width=width, allow_nan=True, allow_infinity=True))


def _scalar(field, hints: dict) -> st.SearchStrategy:
    t = field.type
    if t == FD.TYPE_STRING:
        base = text()
    elif t == FD.TYPE_BYTES:
        base = st.binary(max_size=64)
    elif t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        base = ints(*INT32)
    elif t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        base = ints(*INT64)
    elif t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        base = ints(0, 2 ** 32 - 1)
    elif t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        base = ints(0, 2 ** 64 - 1)
    elif t == FD.TYPE_FLOAT:
        base = floats(32)
    elif t == FD.TYPE_DOUBLE:
        base = floats(64)
    elif t == FD.TYPE_BOOL:
        base = st.booleans()
    elif t == FD.TYPE_ENUM:
        # proto3 enums are open: a number the server does not know arrives as is
        base = st.sampled_from([v.number for v in field.enum_type.values] + [-1, 99, 2 ** 31 - 1])
    else:  # pragma: no cover - groups are proto2 only
        raise TypeError(f"unsupported field type {t} of {field.full_name}")
    hint = hints.get(field.name)
    return st.one_of(hint, base) if hint is not None else base


def message(descriptor, hints: dict | None = None, *, max_repeated: int = 6, depth: int = 3) -> st.SearchStrategy:
    """Any message of ``descriptor``, each field set or left at its default; ``hints`` maps a field name to a
    strategy of plausible values (tried alongside the generic ones), ``max_repeated`` bounds the lists (a share
    of the repeated fields get one element repeated up to 4x longer, past the services' per-request limits)."""
    from google.protobuf import message_factory

    hints = hints or {}
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw):
        msg = cls()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue  # left at its default (absent)
            if field.type == FD.TYPE_MESSAGE:
                if field.message_type.GetOptions().map_entry:
                    key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                    entries = draw(st.dictionaries(_scalar(key_f, {}), _scalar(val_f, {}), max_size=3))
                    getattr(msg, field.name).update(entries)
                    continue
                if depth <= 0:
                    continue
                sub = message(field.message_type, hints, max_repeated=max(1, max_repeated // 2), depth=depth - 1)
                if field.is_repeated:
                    getattr(msg, field.name).extend(draw(_lists(sub, max_repeated)))
                else:
                    getattr(msg, field.name).CopyFrom(draw(sub))
            elif field.is_repeated:
                getattr(msg, field.name).extend(draw(_lists(_scalar(field, hints), max_repeated)))
            else:
                setattr(msg, field.name, draw(_scalar(field, hints)))
        return msg

    return build()


def near(base, generated: st.SearchStrategy) -> st.SearchStrategy:
    """``base`` (a valid request) with some of its fields replaced by those of a generated message of the same
    type, nested messages mixed the same way: hostile values that get past the checks of the other fields."""

    @st.composite
    def build(draw):
        return _mix(base, draw(generated), draw)

    return build()


def _mix(base, gen, draw):
    out = type(base)()
    out.CopyFrom(base)
    for field in base.DESCRIPTOR.fields:
        choice = draw(st.sampled_from(["keep", "keep", "take", "mix"]))
        if choice == "keep" or (field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry):
            continue
        singular_msg = field.type == FD.TYPE_MESSAGE and not field.is_repeated
        if choice == "mix" and singular_msg and base.HasField(field.name):
            getattr(out, field.name).CopyFrom(_mix(getattr(base, field.name), getattr(gen, field.name), draw))
        elif choice == "mix" and field.is_repeated and field.type == FD.TYPE_MESSAGE and len(getattr(base, field.name)):
            # the base's elements, each mixed with a generated one (or kept), plus any extra generated ones
            items = [_mix(b, g, draw) for b, g in zip(getattr(base, field.name), getattr(gen, field.name))]
            items += list(getattr(base, field.name))[len(items):] if draw(st.booleans()) else []
            out.ClearField(field.name)
            getattr(out, field.name).extend(items)
        else:
            out.ClearField(field.name)
            if field.is_repeated:
                getattr(out, field.name).extend(getattr(gen, field.name))
            elif singular_msg:
                if gen.HasField(field.name):
                    getattr(out, field.name).CopyFrom(getattr(gen, field.name))
            else:
                setattr(out, field.name, getattr(gen, field.name))
    return out


def _lists(elements: st.SearchStrategy, max_size: int) -> st.SearchStrategy[list]:
    return st.one_of(st.lists(elements, max_size=max_size),
                     # many copies of one element: past the per-request count limits, still cheap to build
                     st.builds(lambda x, n: [x] * n, elements, st.integers(max_size + 1, 4 * max_size + 8)))


# ---------------------------------------------------------------- JSON bodies
def json_values(max_leaves: int = 8) -> st.SearchStrategy:
    """Any JSON value: null, booleans, 0 / negative / enormous integers, floats with NaN and infinities (Python's
    json writes them), unicode and long strings and some that are not text (keys too), and lists and objects of
    those."""
    leaves = st.one_of(st.none(), st.booleans(), ints(*INT64), st.sampled_from([2 ** 64, -2 ** 70, 10 ** 30]),
                       floats(64), json_text())
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(json_text(8), inner, max_size=4)),
                        max_leaves=max_leaves)


def json_object(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """An object with any subset of ``fields`` (each a plausible value or any JSON value) and maybe an unknown
    key."""

    @st.composite
    def build(draw):
        body = {}
        for name, plausible in fields.items():
            if draw(st.booleans()):
                body[name] = draw(st.one_of(plausible, json_values()))
        if draw(st.integers(0, 4)) == 0:
            body[draw(json_text(8))] = draw(json_values())
        return body

    return build()


def near_json(base: dict, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """``base`` (a valid body) with some fields replaced (by a plausible or any JSON value) or dropped."""

    @st.composite
    def build(draw):
        body = dict(base)
        for name, plausible in fields.items():
            choice = draw(st.sampled_from(["keep", "keep", "keep", "replace", "drop"]))
            if choice == "replace":
                body[name] = draw(st.one_of(plausible, json_values()))
            elif choice == "drop":
                body.pop(name, None)
        return body

    return build()


#: bodies that are not JSON, or JSON that breaks parsers: truncated, invalid UTF-8, nesting deeper than the
#: recursion limit, an integer with more digits than int() converts, bare NaN, a JSON string / list / number
MALFORMED_BODIES = [
    b"", b"{", b'{"queries": ["a"', b"\xff\xfe\x00", b"\x80abc", b"null", b"[]", b'"text"', b"3", b"NaN",
    b"Infinity", b"-Infinity", b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"topk": ' + b"9" * 5_000 + b"}", b'{"n": ' + b"9" * 5_000 + b"}", b'{"seed": 1e999}',
    b'{"queries": ["a"], "queries": 1}', b"{'single': 'quotes'}", b"\x00" * 64, "{\"q\": \"\ud800\"}".encode(
        "utf-8", "surrogatepass"),
]


def encode(value, how: str = "escaped") -> bytes:
    """``value`` as a JSON body: ``escaped`` (Python's json: non-ASCII, a lone surrogate too, as \\uXXXX escapes),
    ``raw`` (UTF-8, a surrogate as its three bytes, which json reads back with surrogatepass) or ``utf-16``."""
    if how == "escaped":
        return json.dumps(value).encode()
    text = json.dumps(value, ensure_ascii=False)
    return text.encode("utf-8" if how == "raw" else "utf-16", "surrogatepass")


ENCODINGS = ("escaped", "raw", "utf-16")


def body_bytes(objects: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """A request body: a generated object serialised (Python's json, NaN included; escaped or raw), a malformed one,
    or bytes."""
    return st.one_of(st.builds(encode, objects, st.sampled_from(ENCODINGS)),
                     st.builds(encode, json_values(), st.sampled_from(ENCODINGS)),
                     st.sampled_from(MALFORMED_BODIES), st.binary(max_size=64))


def string_slots(value, path: str = "") -> list[tuple[str, tuple]]:
    """Every string in a JSON value, object keys included, as (its JSON path, its location: the keys and indexes
    that lead to it); a key's location ends in ("key", k), and its path is then that of the object holding it."""
    out = []
    if isinstance(value, str):
        out.append((path, ()))
    elif isinstance(value, dict):
        for k, v in value.items():
            p = f"{path}.{k}" if path else k
            out.append((path, (("key", k),)))
            out += [(sp, (k,) + loc) for sp, loc in string_slots(v, p)]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += [(sp, (i,) + loc) for sp, loc in string_slots(v, f"{path}[{i}]")]
    return out


def spoil(value, loc: tuple, sur: str, at: int):
    """A copy of ``value`` with the string at ``loc`` (string_slots) holding ``sur`` at position ``at``."""
    if not loc:
        return value[:at] + sur + value[at:]
    head = loc[0]
    if isinstance(head, tuple):  # ("key", k): the key itself
        k = head[1]
        return {(k[:at] + sur + k[at:] if key == k else key): v for key, v in value.items()}
    out = list(value) if isinstance(value, list) else dict(value)
    out[head] = spoil(value[head], loc[1:], sur, at)
    return out


def spoiled(bodies: st.SearchStrategy) -> st.SearchStrategy[tuple[bytes, str]]:
    """(body, the JSON path of its one string that is not text): a body of ``bodies`` (all of whose strings are
    text, and whose keys are plain names) with a lone surrogate put into one of its strings or keys, serialised
    escaped, raw or as UTF-16. A key's path is its object's and ``["<the key, JSON-escaped>"] (a key)``."""

    @st.composite
    def build(draw):
        body = draw(bodies)
        path, loc = draw(st.sampled_from(string_slots(body)))
        target = body
        for step in loc:
            target = step[1] if isinstance(step, tuple) else target[step]
        sur, at = draw(st.sampled_from(SURROGATES)), draw(st.integers(0, len(target)))
        if loc and isinstance(loc[-1], tuple):
            path = f"{path}[{json.dumps(target[:at] + sur + target[at:])}] (a key)"
        return encode(spoil(body, loc, sur, at), draw(st.sampled_from(ENCODINGS))), path

    return build()
