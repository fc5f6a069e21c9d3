"""One JSON POST for the tests of the services' HTTP front ends, an error status answered like a success."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request


def post_json(url: str, body=None, *, raw: bytes | None = None, token: str | None = None,
              context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """POST ``body`` as JSON (or ``raw``, bytes sent as they are) to ``url``, with a bearer ``token`` when given;
    returns (HTTP status, the answer's JSON), for an error status too."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
