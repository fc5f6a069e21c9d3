"""What every ProRAG gRPC server shares: the error-mapping interceptor, health,
reflection, message-size limits, UNIMPLEMENTED placeholders and graceful shutdown.

A service's servicer stays thin (validate, convert, call the engine); engines raise
:mod:`prorag.errors` exceptions, and :class:`ErrorMappingInterceptor` is the one place
they become statuses. A caller's mistake therefore never surfaces as UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prorag.errors import ProragError
from prorag.rpc.observability import ObservabilityInterceptor
from prorag.rpc.security import AuthInterceptor, ServerSecurity

log = logging.getLogger("prorag.grpc")

MiB = 1024 * 1024


def _error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ProragError):
        return exc.code, str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the operation did not finish before its deadline"
    if type(exc).__name__ == "OutOfMemoryError":  # torch's, matched by name so this module never imports torch
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (f"out of memory on the accelerator serving this request: {exc}; "
                                                    "send a smaller request or retry later")
    return grpc.StatusCode.INTERNAL, (f"internal error ({type(exc).__name__}): {exc}; this is a server bug, please "
                                      "report it")


#: most UTF-8 bytes of a status message: gRPC sends it percent-encoded in a header, and a header past 8 KiB
#: reaches the caller as RESOURCE_EXHAUSTED about metadata instead of the status and message it was sent
MAX_MESSAGE_BYTES = 2048


def clip_message(msg: str) -> str:
    """``msg`` cut to MAX_MESSAGE_BYTES (a message quoting a huge caller's value stays readable and deliverable)."""
    raw = msg.encode("utf-8", "replace")
    if len(raw) <= MAX_MESSAGE_BYTES:
        return msg
    return raw[:MAX_MESSAGE_BYTES - 64].decode("utf-8", "ignore") + f"... ({len(msg):,} characters in all)"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns engine exceptions into gRPC statuses with the engine's message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def abort(context, exc):
            code, msg = _error_status(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method, exc_info=exc)
            await context.abort(code, clip_message(msg))

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status below
                    await abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001
                    await abort(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def unimplemented_servicer(base_cls: type, service_name: str, reason: str) -> Any:
    """An instance of ``base_cls`` whose every RPC answers UNIMPLEMENTED with ``reason``."""

    def make(method_name: str, streaming: bool):
        msg = f"{service_name}/{method_name} is not implemented in this release: {reason}"
        if streaming:
            async def stream_method(self, request, context):
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, msg)
                yield  # pragma: no cover - makes this an async generator

            return stream_method

        async def method(self, request, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, msg)

        return method

    attrs = {}
    for name in dir(base_cls):
        if name.startswith("_") or not callable(getattr(base_cls, name)):
            continue
        attrs[name] = make(name, streaming=name in STREAMING_METHODS.get(service_name, ()))
    return type(f"Unimplemented{base_cls.__name__}", (base_cls,), attrs)()


STREAMING_METHODS = {
    "prorag.v1.Policy": ("Rollout",),
    "prorag.v1.Trainer": ("WatchJob",),
}


@dataclass
class ServerSpec:
    """What one process serves: its gRPC services and how to shut them down."""

    name: str                                   # "retriever", ...
    services: list[tuple[str, Callable[[grpc.aio.Server], None]]]  # (full service name, add_fn)
    ready: dict[str, bool] = field(default_factory=dict)  # per-service readiness at start
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any
    spec: ServerSpec

    async def set_ready(self, service: str, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace: float = 5.0) -> None:
        # Flip readiness first so load balancers stop routing, then drain in-flight calls.
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for fn in self.spec.on_stop:
            await fn()


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic()'s clock (None: the caller set none), for work the servicer hands on."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def start_server(spec: ServerSpec, port: int, host: str = "127.0.0.1",
                       max_message_mb: int = 64, max_concurrent_rpcs: int | None = None,
                       security: ServerSecurity | None = None) -> RunningServer:
    """Start a grpc.aio server with interceptors, health and reflection on host:port (0 = any free).

    ``security`` (default: plaintext, no auth) adds TLS and the bearer-token check; health stays open."""
    security = security or ServerSecurity()
    # Outermost of all: every call is counted and logged with the status its caller got, refused ones too.
    interceptors: list[grpc.aio.ServerInterceptor] = [ObservabilityInterceptor(spec.name)]
    tokens = security.tokens()
    if tokens is not None:
        # Before the servicers, so an unauthenticated call never reaches one.
        interceptors.append(AuthInterceptor(tokens, spec.name))
    interceptors.append(ErrorMappingInterceptor())
    options = [
        ("grpc.max_receive_message_length", max_message_mb * MiB),
        ("grpc.max_send_message_length", max_message_mb * MiB),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options,
                             maximum_concurrent_rpcs=max_concurrent_rpcs or None)
    for _, add in spec.services:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [n for n, _ in spec.services]
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.grpc_credentials()
    bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
             else server.add_insecure_port(f"{host}:{port}"))
    if bound == 0:
        raise OSError(f"could not bind {host}:{port} for the {spec.name} service (port in use?)")
    await server.start()
    running = RunningServer(server, bound, health_servicer, spec)
    # "" is liveness: the process answers. Each service name is its readiness.
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for n in names:
        await health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING if spec.ready.get(n, True)
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("%s listening on %s:%d (%s)", spec.name, host, bound, security.describe())
    return running


async def serve_until_signal(stoppers: list[Callable[[], Awaitable[None]]]) -> None:
    """Block until SIGINT/SIGTERM, then run every stopper once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for fn in stoppers:
        await fn()
