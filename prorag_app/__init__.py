"""The application layer: the `prorag` command, the main-job pipeline, benchmarks, the local process stack,
the embedded-default builder and the evaluation runners. The only package that may import services/."""

import prorag as _prorag  # noqa: F401  (sets OMP_WAIT_POLICY before torch or faiss load)
