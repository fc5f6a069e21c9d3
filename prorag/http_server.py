"""Starting an aiohttp application on a host and port: the HTTP side of the services' plumbing."""

from __future__ import annotations

from aiohttp import web


async def start_http(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # port 0 -> the real one
    return runner, bound
