"""`prorag bench <target> --json`: measured, never assumed.

Every figure is compared in the same run against the in-process limit (the same engine called directly, no
network) and reported as a ratio. Each measurement is repeated and the median kept. The last output line is one
JSON object. One module per benchmark; what they share (service processes, percentiles, medians, the machine's
description) is in :mod:`prorag_app.bench.harness`, the models they measure in :mod:`prorag_app.bench.models`.
"""

from __future__ import annotations

from prorag_app.bench.load import bench_load, bench_soak
from prorag_app.bench.policy import bench_policy
from prorag_app.bench.prm import bench_prm
from prorag_app.bench.retriever import bench_retriever
from prorag_app.bench.rl import bench_rl
from prorag_app.bench.sft import bench_sft
from prorag_app.bench.swap import bench_swap

#: `prorag bench <target>` -> its benchmark, taking the parsed arguments and returning the JSON object
BENCHES = {"retriever": bench_retriever, "policy": bench_policy, "swap": bench_swap, "sft": bench_sft,
           "prm": bench_prm, "rl": bench_rl, "load": bench_load, "soak": bench_soak}
