"""Model-FLOPs utilisation: the machine's measured peak matmul FLOP/s and the 6 x parameters x tokens rule.

MFU = tokens/s x 6 x parameters / peak (Kaplan et al. 2020; PaLM's definition without the attention
term): a forward and backward pass cost about 6 FLOPs per parameter per token. The peak is measured,
not taken from a spec sheet, so the figure says how far a training step is from what this process
gets out of one plain matmul on the same device with the same threads, in the dtype the step computes in
(a bf16 step against an fp32 peak would read ~26x too high on an H200).
"""

from __future__ import annotations

import functools
import time

import torch

#: matmul size of the peak benchmark: large enough to reach BLAS peak on a CPU, ~20 ms per call on 2 cores
BENCH_N = 1024
#: on a GPU a 1024^3 product is launch-bound; 8192^3 reaches the tensor cores' peak (~0.7 ms in bf16 on an H100)
BENCH_N_CUDA = 8192


@functools.lru_cache(maxsize=None)
def _measure(device: str, threads: int, seconds: float, dtype: torch.dtype = torch.float32) -> float:
    n = BENCH_N_CUDA if device.startswith("cuda") else BENCH_N
    gen = torch.Generator(device).manual_seed(0)  # a private generator: a training run's RNG stream is untouched
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b)  # first call: allocation and BLAS set-up
    sync()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or spent < seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return 2.0 * n ** 3 / best


def peak_matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      seconds: float = 0.25) -> float:
    """Best FLOP/s of an n x n matmul in ``dtype`` over ~``seconds`` (n = BENCH_N, BENCH_N_CUDA on a GPU),
    measured once per process for each (device, torch thread count, dtype) and cached (the fastest call, so a
    busy neighbour lowers it least)."""
    device = str(torch.device(device)) if str(device) != "cuda" else "cuda:0"
    return _measure(device, torch.get_num_threads(), seconds, dtype)


def model_flops_utilisation(tokens_per_s: float, num_params: int, peak_flops: float) -> float:
    """tokens_per_s x 6 x num_params / peak_flops (a fraction; 1.0 = the measured peak)."""
    return tokens_per_s * 6.0 * num_params / peak_flops


__all__ = ["BENCH_N", "model_flops_utilisation", "peak_matmul_flops"]
