"""Where things live: data (worlds, indexes, models) and runs. PRORAG_HOME moves both."""

from __future__ import annotations

import os
from pathlib import Path

#: documented default ports; `prorag up --port-offset N` shifts every one by N
GRPC_PORTS = {"retriever": 50051, "policy": 50052, "prm": 50053, "judge": 50054, "trainer": 50055}
HTTP_PORTS = {"retriever": 8000, "policy": 8001}
#: Prometheus /metrics of each service (plain HTTP; `prorag serve --metrics-port`, -1 = off)
METRICS_PORTS = {"retriever": 9101, "policy": 9102, "prm": 9103, "judge": 9104, "trainer": 9105}
SERVICES = tuple(GRPC_PORTS)


def home() -> Path:
    return Path(os.environ.get("PRORAG_HOME", Path.cwd())).resolve()


def data_dir() -> Path:
    return Path(os.environ.get("PRORAG_DATA", home() / "data"))


def runs_dir() -> Path:
    return Path(os.environ.get("PRORAG_RUNS", home() / "runs"))


def world_dir(name: str = "default") -> Path:
    return data_dir() / "worlds" / name


def index_dir(world: str = "default") -> Path:
    return data_dir() / "indexes" / world
