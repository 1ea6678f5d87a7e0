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


def top_device_time(fn: Callable[[], object], step_ms: float, top: int = 15) -> list[dict]:
    """The largest device-time entries (kernels by name) of one fn() call under torch.profiler,
    each with its share of step_ms. Entries overlap nowhere on one stream, so shares add up."""
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(({"kernel": e.key, "calls": e.count, "ms": e.device_time_total / 1e3,
                    "share": e.device_time_total / 1e3 / step_ms} for e in events),
                  key=lambda r: -r["ms"])
    return rows[:top]
