"""One gRPC client interceptor that rewrites every call's metadata, in all four call shapes (unary and streaming
requests and replies). Its two uses: the bearer token (prorag.rpc.security) and the request id that follows a rollout
from service to service (prorag.rpc.observability)."""

from __future__ import annotations

import abc

import grpc


class _Details(grpc.ClientCallDetails):
    # what gRPC passes is a namedtuple in current releases (hence _replace); this covers the ones where it is not
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata, self.credentials = d.method, d.timeout, metadata, d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Calls go out with ``metadata(existing)`` as their metadata (None: unchanged)."""

    @abc.abstractmethod
    def metadata(self, existing: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
        """The call's metadata given what it carries (``existing``); None leaves the call as it is."""

    def _details(self, d):
        metadata = self.metadata(list(d.metadata or ()))
        if metadata is None:
            return d
        return d._replace(metadata=metadata) if hasattr(d, "_replace") else _Details(d, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # e.g. reflection
        return continuation(self._details(client_call_details), request_iterator)


__all__ = ["MetadataInterceptor"]
