"""Starting an aiohttp application on a host and port: the HTTP side of the services' plumbing,
with the same TLS and bearer tokens as the service's gRPC side."""

from __future__ import annotations

from aiohttp import web

from prorag.rpc.observability import http_middleware
from prorag.rpc.security import ServerSecurity, http_auth_middleware


async def start_http(app: web.Application, host: str, port: int, security: ServerSecurity | None = None,
                     name: str = "service") -> tuple[web.AppRunner, int]:
    security = security or ServerSecurity()
    tokens = security.tokens()
    if tokens is not None:
        app.middlewares.insert(0, http_auth_middleware(tokens, name))
    app.middlewares.insert(0, http_middleware(name))  # outermost: refused requests are counted too
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=security.ssl_context())
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # port 0 -> the real one
    return runner, bound
