"""ProRAG as services: the core package shared by every service (formats, metrics, data, clients)."""

import os as _os

# torch and faiss each bundle an OpenMP runtime; with the default busy-wait policy idle threads
# spin on the cores others need (measured 3-10x slowdowns on 2 shared cores). It only takes
# effect before either library loads, and every entry point imports this package first.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
