"""Retriever service: encoders, index building and the retrieval engine."""

import os

# torch and faiss each bundle an OpenMP runtime; with the default busy-wait policy the idle
# threads of one spin on the cores the other needs (query encoding measured 3-4x slower on 2
# cores). Only effective when set before either library loads, hence here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
