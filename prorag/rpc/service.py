"""Lifecycle of one service process: start its gRPC (and HTTP) servers, stop them cleanly."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web

from prorag.config import cfg_field
from prorag.rpc.grpc_server import RunningServer, ServerSpec, start_server
from prorag.rpc.http_server import start_http
from prorag.rpc.observability import start_metrics_http
from prorag.rpc.security import ServerSecurity


@dataclass
class ServeConfig:
    """Network settings every service takes."""

    host: str = cfg_field("127.0.0.1", help="address to bind; containers use 0.0.0.0")
    port: int = cfg_field(0, help="gRPC port (0 = any free port)", min=0, max=65535)
    http_port: int = cfg_field(-1, help="HTTP port where the service has one (0 = any free, -1 = off)",
                               min=-1, max=65535)
    metrics_port: int = cfg_field(-1, help="Prometheus /metrics port, plain HTTP (0 = any free, -1 = off; `prorag "
                                           "serve` defaults to the service's port in prorag.paths.METRICS_PORTS)",
                                  min=-1, max=65535)
    max_message_mb: int = cfg_field(64, help="gRPC max send/receive message size, MiB", min=1, max=2047)
    grace_s: float = cfg_field(5.0, help="seconds in-flight calls get to finish at shutdown", min=0)
    max_concurrent_rpcs: int = cfg_field(256, help="calls served at once; more are refused with RESOURCE_EXHAUSTED "
                                                   "(0 = no limit)", min=0)
    tls_cert: str = cfg_field("", help="PEM certificate chain: serve TLS ('' = $PRORAG_TLS_CERT, unset = plaintext)")
    tls_key: str = cfg_field("", help="PEM key of tls_cert ('' = $PRORAG_TLS_KEY)")
    tls_client_ca: str = cfg_field("", help="PEM CA bundle: require client certificates it signed, mutual TLS "
                                            "('' = $PRORAG_TLS_CLIENT_CA)")
    auth_tokens: str = cfg_field("", help="YAML tokens file: require bearer tokens with scopes "
                                          "('' = $PRORAG_AUTH_TOKENS, unset = no auth)")

    def security(self) -> ServerSecurity:
        """The TLS and token settings, each field falling back to its environment variable."""
        env = ServerSecurity.from_env()
        return ServerSecurity(tls_cert=self.tls_cert or env.tls_cert, tls_key=self.tls_key or env.tls_key,
                              tls_client_ca=self.tls_client_ca or env.tls_client_ca,
                              auth_tokens=self.auth_tokens or env.auth_tokens)


@dataclass
class Started:
    name: str
    grpc_port: int
    http_port: int | None = None
    stoppers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def stop(self) -> None:
        for fn in self.stoppers:
            await fn()


async def start_grpc_and_http(serve: ServeConfig, spec: ServerSpec,
                              http_app: Callable[[], web.Application] | None = None) -> tuple[RunningServer, Started]:
    """A service's gRPC server and, where it has an HTTP API (``http_app`` builds it) and serve.http_port asks for
    it, its HTTP server, both with serve's TLS and tokens. The Started stops the HTTP side first, so no new
    request gets in while the gRPC side drains."""
    security = serve.security()
    running = await start_server(spec, serve.port, serve.host, serve.max_message_mb, serve.max_concurrent_rpcs,
                                 security=security)
    started = Started(spec.name, running.port, None, [lambda: running.stop(serve.grace_s)])
    if http_app is not None and serve.http_port >= 0:
        try:
            runner, started.http_port = await start_http(http_app(), serve.host, serve.http_port, security,
                                                         spec.name)
        except BaseException:
            await running.stop(0)  # a taken HTTP port fails the start; the gRPC port it bound is let go
            raise
        started.stoppers.insert(0, runner.cleanup)
    return running, started


def start_metrics(serve: ServeConfig, name: str,
                  required: bool = True) -> tuple[int | None, Callable[[], Awaitable[None]]]:
    """The process's /metrics endpoint on serve.host:serve.metrics_port: (bound port or None, stopper).

    One per process, not per server: the metrics live in prometheus_client's process-wide registry. A taken port
    fails the start when ``required`` (a port the operator chose); otherwise it is logged and the service runs
    without metrics, so that two local processes left on the default port do not stop each other starting."""
    async def nothing() -> None:
        return None

    if serve.metrics_port < 0:
        return None, nothing
    try:
        server, port = start_metrics_http(serve.host, serve.metrics_port)
    except OSError as e:
        if required:
            raise OSError(f"could not bind {serve.host}:{serve.metrics_port} for the {name} service's metrics "
                          f"({e}); choose another --metrics-port, or -1 for none") from None
        logging.getLogger("prorag.metrics").warning(
            "%s: metrics port %s:%d is taken (%s); serving without /metrics (set --metrics-port)", name, serve.host,
            serve.metrics_port, e)
        return None, nothing

    async def stop() -> None:
        await asyncio.to_thread(server.shutdown)
        server.server_close()

    return port, stop
