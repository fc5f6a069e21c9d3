"""The application layer: the `prorag` command, the main-job pipeline, benchmarks, the local process stack,
the embedded-default builder and the evaluation runners. The only package that may import services/."""

import os as _os

# This layer starts its services by fork + exec (prorag_app/procs.py) from processes that hold gRPC servers and
# channels. With gRPC's fork support on (grpcio's default), the child restarts gRPC's epoll poller thread after
# the fork; closing the inherited descriptors before exec then aborts the child (SIGABRT, "epoll_wait error: Bad
# file descriptor" in the service's log), now and then and more often under load (grpc/grpc#43055, a regression
# of grpcio 1.81). Nothing here uses gRPC in a forked child, so the support is off, for the services too (they
# inherit the environment). Read when grpc is first imported, which this package's import precedes.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import prorag as _prorag  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch or faiss load)
