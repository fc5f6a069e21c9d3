"""HTTP ``POST /retrieve`` with exactly the request and response of Search-R1's
retrieval server, so existing rollout code calls this service unchanged:

    {"queries": [str], "topk": int, "return_scores": bool}
 -> {"result": [[{"document": {"id": str, "contents": "\"Title\"\ntext"}, "score": float}, ...], ...]}

Scores are always returned: Search-R1's own server fails when ``return_scores`` is
false, and clients read ``item["document"]["contents"]`` either way.
Client mistakes get 4xx with ``{"error": message}``; the server keeps serving. This module only turns
JSON into typed values (and back); the front end checks the request as it does for gRPC.
"""

from __future__ import annotations

import logging

from aiohttp import web

from prorag.errors import InvalidArgument, ProragError
from prorag.rpc.jsonbody import read_json
from services.retriever.frontend import SearchFrontend

log = logging.getLogger("prorag.retriever.http")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def make_app(frontend: SearchFrontend, default_topk: int = 3, max_body_mb: int = 16) -> web.Application:
    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise InvalidArgument('body must be a JSON object like {"queries": ["..."], "topk": 3}')
            unknown = set(body) - {"queries", "topk", "return_scores", "index"}
            if unknown:
                raise InvalidArgument(f"unknown field(s) {sorted(unknown)}; allowed: queries, topk, return_scores, "
                                      "index")
            queries = body.get("queries")
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise InvalidArgument('"queries" must be a list of strings')
            topk = body.get("topk", default_topk)
            if topk is None:
                topk = default_topk
            if isinstance(topk, bool) or not isinstance(topk, int):
                raise InvalidArgument(f'"topk" must be an integer, got {topk!r}')
            index = body.get("index", "") or ""
            if not isinstance(index, str):
                raise InvalidArgument('"index" must be a string')
            _, results = await frontend.search(queries, topk, index)
        except ProragError as e:
            return _error(e.http_status, str(e))
        except Exception as e:  # noqa: BLE001 - a server bug; keep serving
            log.exception("retrieve failed")
            return _error(500, f"internal error ({type(e).__name__}): {e}")
        return web.json_response({"result": [
            [{"document": {"id": d.id, "contents": d.contents}, "score": float(d.score)} for d in docs]
            for docs in results]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "indexes": [i["name"] for i in frontend.list_indexes()]})

    app = web.Application(client_max_size=max_body_mb * 1024 * 1024)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app
