"""Reading JSON a caller sent (an HTTP body, a trainer job's config): every way it can fail is the caller's mistake
and says so (InvalidArgument, HTTP 400; a body over the size cap 413), never a server error.

``json.loads`` fails in more ways than JSONDecodeError: bytes that are not UTF-8 (UnicodeDecodeError), arrays or
objects nested deeper than the interpreter's recursion limit (RecursionError), an integer with more digits than
``int()`` converts (ValueError, ``sys.int_max_str_digits``). And what parses can still hold a string that is not
Unicode text: a ``\\uD800`` escape, or a surrogate encoded in the bytes (json reads them with ``surrogatepass``), which
a tokenizer or a file name then fails on; refused here with the JSON path of the string (prorag.jsontext)."""

from __future__ import annotations

import json
from typing import Any

from prorag.errors import InvalidArgument, ResourceExhausted
from prorag.jsontext import MAY_HOLD_SURROGATES, check_strings


class BodyTooLarge(ResourceExhausted):
    http_status = 413


def loads(data: str | bytes, what: str = "request body") -> Any:
    """``json.loads`` of a caller's text (bytes: UTF-8, or UTF-16/32 as RFC 8259 allows), every failure an
    InvalidArgument naming ``what``; a string in it that is not Unicode text (a lone surrogate) too, naming its
    JSON path (``queries[0]``)."""
    try:
        if isinstance(data, (bytes, bytearray)):
            # as json.loads does with bytes (its encoding, surrogatepass), so the text can be looked at below
            data = bytes(data).decode(json.detect_encoding(data), "surrogatepass")
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{what} is not UTF-8 text: {e}") from None
    except RecursionError:
        raise InvalidArgument(f"{what} nests arrays or objects too deeply to parse; send a flatter document") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise InvalidArgument(f"{what} holds a value that cannot be read: {e}") from None
    if MAY_HOLD_SURROGATES.search(data):  # else no string in it can hold one: no walk over a large body
        check_strings(value, what)
    return value


async def read_json(request, what: str = "request body") -> Any:
    """The JSON body of an aiohttp request (the Content-Type's charset is not trusted: JSON is UTF-8)."""
    from aiohttp import web

    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise BodyTooLarge(f"{what} is larger than this server accepts: {e.text.rstrip('.')}; "
                           "send a smaller request") from None
    return loads(raw, what)
