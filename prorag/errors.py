"""Errors a caller can act on, each tied to one gRPC status and one HTTP status.

Engines raise these; the one error-mapping interceptor per server (prorag.rpc.grpc_server)
turns them into statuses, and the HTTP front ends into 4xx/5xx JSON bodies. Anything
else escaping a handler is a bug on our side and is reported as INTERNAL.
"""

from __future__ import annotations

import grpc


class ProragError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500


class InvalidArgument(ProragError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(ProragError, KeyError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(ProragError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class AlreadyExists(ProragError):
    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class ResourceExhausted(ProragError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(ProragError):
    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(ProragError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unimplemented(ProragError):
    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


class Cancelled(ProragError):
    code = grpc.StatusCode.CANCELLED
    http_status = 499
