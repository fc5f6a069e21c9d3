"""Lifecycle of one service process: start its gRPC (and HTTP) servers, stop them cleanly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

from prorag.config import cfg_field


@dataclass
class ServeConfig:
    """Network settings every service takes."""

    host: str = cfg_field("127.0.0.1", help="address to bind; containers use 0.0.0.0")
    port: int = cfg_field(0, help="gRPC port (0 = any free port)", min=0, max=65535)
    http_port: int = cfg_field(-1, help="HTTP port where the service has one (0 = any free, -1 = off)",
                               min=-1, max=65535)
    max_message_mb: int = cfg_field(64, help="gRPC max send/receive message size, MiB", min=1, max=2047)
    grace_s: float = cfg_field(5.0, help="seconds in-flight calls get to finish at shutdown", min=0)


@dataclass
class Started:
    name: str
    grpc_port: int
    http_port: int | None = None
    stoppers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def stop(self) -> None:
        for fn in self.stoppers:
            await fn()
