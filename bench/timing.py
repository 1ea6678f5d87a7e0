"""Median wall time of a callable, synchronising CUDA around each sample."""

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() over iters calls, after warmup calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)
