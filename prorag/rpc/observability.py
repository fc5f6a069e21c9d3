"""What operators watch: Prometheus metrics of every RPC and HTTP call, one JSON log line per call, and a request
id that follows a call from service to service.

The id rides in the ``x-request-id`` gRPC metadata (``X-Request-Id`` over HTTP): the server interceptor takes it
from the caller (or makes one), keeps it in a contextvar for the call, and the typed clients' channel
(:func:`prorag.rpc.clients.channel`) sends the current one with every outgoing call, so the retriever's log line of a
search made by a policy rollout carries the rollout's id. Work handed to a thread pool keeps it only when run in
a copied context (``contextvars.copy_context().run``; ``asyncio.to_thread`` does that already).

Metric names follow go-grpc-prometheus (``grpc_server_handled_total``, ``grpc_server_handling_seconds``), which
existing gRPC dashboards read. Everything goes to prometheus_client's default registry: one /metrics endpoint
per process (:func:`start_metrics_http`) shows every server of the process plus the process collectors (CPU,
memory, open files).
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as _dt
import json
import logging
import re
import time
import uuid

import grpc
from prometheus_client import Counter, Histogram, start_http_server

from prorag.rpc.grpc_metadata import MetadataInterceptor

REQUEST_ID_KEY = "x-request-id"  # gRPC metadata keys are lower case; HTTP's X-Request-Id is the same header

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("prorag_request_id", default="")
# a caller's id is echoed into our logs and forwarded on: bounded and plain so it cannot forge log structure
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)  # up to a long rollout's ten minutes

RPC_STARTED = Counter("grpc_server_started_total", "RPCs started on the server",
                      ["grpc_service", "grpc_method", "grpc_type"])
RPC_HANDLED = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code",
                      ["grpc_service", "grpc_method", "grpc_type", "grpc_code"])
RPC_SECONDS = Histogram("grpc_server_handling_seconds", "Time from an RPC's start to its status, seconds",
                        ["grpc_service", "grpc_method", "grpc_type"], buckets=LATENCY_BUCKETS)
HTTP_REQUESTS = Counter("prorag_http_requests_total", "HTTP requests served, by route and status code",
                        ["route", "method", "code"])
HTTP_SECONDS = Histogram("prorag_http_request_duration_seconds", "Time to answer an HTTP request, seconds",
                         ["route", "method"], buckets=LATENCY_BUCKETS)

log = logging.getLogger("prorag.rpc")

# health checks and reflection are polled by probes and tools: counted, but logged only at DEBUG
_QUIET_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                   "grpc.reflection.v1.ServerReflection")


# ---------------------------------------------------------------- request ids
def current_request_id() -> str:
    """The id of the call being served in this context ('' outside one)."""
    return _request_id.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


def accept_request_id(value) -> str:
    """The caller's id when it is a plain token of at most 128 characters, else a new one."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) and _VALID_ID.fullmatch(value) else new_request_id()


def _reset(token: contextvars.Token) -> None:
    try:
        _request_id.reset(token)
    except ValueError:  # a stream closed from another context (its generator finalised late): nothing to undo
        pass


def set_request_id(value: str) -> contextvars.Token:
    return _request_id.set(value)


def reset_request_id(token: contextvars.Token) -> None:
    _request_id.reset(token)


# ---------------------------------------------------------------- logs
class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, rpc, status, latency_ms, request_id, message (the keys are
    always there, null when they do not apply), logger, and error (the traceback) when there is one."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": getattr(record, "service", None) or self.service or None,
            "rpc": getattr(record, "rpc", None),
            "status": getattr(record, "status", None),
            "latency_ms": getattr(record, "latency_ms", None),
            "request_id": getattr(record, "request_id", None) or current_request_id() or None,
            "message": record.getMessage(),
            "logger": record.name,
        }
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(service: str, fmt: str = "json", level: int = logging.INFO) -> None:
    """The process's log lines on stderr: JSON (one object per line) or the plain text format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service) if fmt == "json"
                         else logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _log_call(service: str, rpc: str, status: str, seconds: float, request_id: str, message: str,
              level: int) -> None:
    if log.isEnabledFor(level):
        log.log(level, message[:500], extra={"service": service, "rpc": rpc, "status": status,
                                             "latency_ms": round(seconds * 1000.0, 3), "request_id": request_id})


_WARN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
_ERROR_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def _status_code(context, fallback: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if code is None:
        return fallback
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES_BY_VALUE.get(int(code), fallback)  # grpc.aio may hold the raw integer


# ---------------------------------------------------------------- gRPC server side
class ObservabilityInterceptor(grpc.aio.ServerInterceptor):
    """Per call: the request id into the context, grpc_server_* metrics, one log line with the status and latency.

    Installed outermost by :func:`prorag.rpc.grpc_server.start_server`, so calls refused by the token check and
    engine errors mapped by the error interceptor are counted with the status the caller got."""

    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.stream_unary or handler.stream_stream:
            return handler  # no RPC of ours streams requests (reflection does; it is left as it is)
        full = handler_call_details.method  # "/prorag.v1.Retriever/Search"
        grpc_service, _, grpc_method = full.lstrip("/").rpartition("/")
        kind = "unary" if handler.unary_unary else "server_stream"
        rid = accept_request_id(next((v for k, v in (handler_call_details.invocation_metadata or ())
                                      if k == REQUEST_ID_KEY), None))
        quiet = grpc_service in _QUIET_SERVICES
        labels = (grpc_service, grpc_method, kind)
        finish = self._finisher(labels, f"{grpc_service}/{grpc_method}", rid, quiet)
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                token, t0, fallback = _request_id.set(rid), time.perf_counter(), grpc.StatusCode.OK
                RPC_STARTED.labels(*labels).inc()
                try:
                    return await inner(request, context)
                except asyncio.CancelledError:
                    fallback = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    fallback = grpc.StatusCode.UNKNOWN  # what grpc answers for an exception nobody mapped
                    raise
                finally:
                    finish(context, fallback, t0)
                    _reset(token)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)

        inner_stream = handler.unary_stream  # an async generator: the error interceptor's wrapper

        async def unary_stream(request, context):
            token, t0, fallback = _request_id.set(rid), time.perf_counter(), grpc.StatusCode.OK
            RPC_STARTED.labels(*labels).inc()
            try:
                async for item in inner_stream(request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                fallback = grpc.StatusCode.CANCELLED  # the caller went away mid-stream
                raise
            except BaseException:
                fallback = grpc.StatusCode.UNKNOWN
                raise
            finally:
                finish(context, fallback, t0)
                _reset(token)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

    def _finisher(self, labels, rpc: str, rid: str, quiet: bool):
        def finish(context, fallback: grpc.StatusCode, t0: float) -> None:
            seconds = time.perf_counter() - t0
            code = _status_code(context, fallback)
            RPC_HANDLED.labels(*labels, code.name).inc()
            RPC_SECONDS.labels(*labels).observe(seconds)
            level = (logging.DEBUG if quiet else logging.ERROR if code in _ERROR_CODES
                     else logging.WARNING if code in _WARN_CODES else logging.INFO)
            message = "ok" if code == grpc.StatusCode.OK else (context.details() or code.name)
            if isinstance(message, bytes):
                message = message.decode("utf-8", "replace")
            _log_call(self.service, rpc, code.name, seconds, rid, message, level)

        return finish


# ---------------------------------------------------------------- gRPC client side
class RequestIdForwarding(MetadataInterceptor):
    """Sends the current request id (when the caller is serving one) as ``x-request-id`` metadata."""

    def metadata(self, existing):
        rid = _request_id.get()
        if not rid:
            return None
        return [(k, v) for k, v in existing if k != REQUEST_ID_KEY] + [(REQUEST_ID_KEY, rid)]


# ---------------------------------------------------------------- HTTP side
def http_middleware(service: str):
    """aiohttp middleware: X-Request-Id in (or a new one) and back out, prorag_http_* metrics, one log line."""
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        rid = accept_request_id(request.headers.get("X-Request-Id"))
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"  # bounded label values
        token, t0, status = _request_id.set(rid), time.perf_counter(), 500
        try:
            response = await handler(request)
            status = response.status
            response.headers["X-Request-Id"] = rid
            return response
        except web.HTTPException as e:
            status = e.status
            e.headers["X-Request-Id"] = rid
            raise
        finally:
            seconds = time.perf_counter() - t0
            HTTP_REQUESTS.labels(route, request.method, str(status)).inc()
            HTTP_SECONDS.labels(route, request.method).observe(seconds)
            level = logging.ERROR if status >= 500 else logging.INFO
            _log_call(service, f"{request.method} {route}", str(status), seconds, rid,
                      "ok" if status < 400 else f"HTTP {status}", level)
            _request_id.reset(token)

    return middleware


# ---------------------------------------------------------------- the /metrics endpoint
def start_metrics_http(host: str, port: int):
    """Serve the default registry on http://host:port/metrics from a daemon thread (it keeps answering while the
    event loop is busy). Returns (server, bound port); ``server.shutdown()`` stops it. OSError when the port is
    taken."""
    server, _thread = start_http_server(port, addr=host)
    return server, server.server_port
