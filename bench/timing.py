"""Timing on the GPU machine: medians of a callable (wall time with syncs, or CUDA events), the
copy roofline, the host's issue time and a step's device profile by kernel class."""

import gzip
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def event_timed(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() over iters calls after warmup calls: CUDA events around each
    call on CUDA (device time, launch gaps included), wall time elsewhere."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(samples)


def copy_bandwidth(device: str) -> float:
    """GB/s of a large device-to-device copy (bytes read + written): the memory roofline as
    measured, not as quoted."""
    src = torch.empty(2**28 if device == "cuda" else 2**22, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = event_timed(lambda: dst.copy_(src), device, 3, 10)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def graphed_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median ms of fn captured in a CUDA graph and replayed: its device time alone, without the
    host's launch cost, as the CUDA-graphed training step pays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (JIT, allocator) off the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return event_timed(graph.replay, "cuda", warmup, iters)


def host_issue_ms(fn: Callable[[], object], device: str, iters: int) -> float:
    """Median milliseconds fn() takes to return, started on an idle GPU and not waiting for it:
    the host's time to issue a step's work (plus any wait a host sync inside forces). Close to
    the step's time, the step is host-bound: the GPU waits for launches, not the reverse."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - start))
    sync()
    return statistics.median(samples)


# Kernel classes of a training step, by the first matching name fragment (lower case). Our own
# Triton ops keep their kernels' names under Inductor, so they come first; Inductor names its
# kernels triton_{poi,red,per,tem}_fused_<aten ops>; its templates are GEMMs.
KERNEL_CLASSES = (
    ("attn_res / short_conv ops", ("attn_res", "short_conv")),
    ("gemm", ("triton_tem", "nvjet", "cutlass", "gemm", "sm90_xmma", "cublas")),
    ("inductor (fused)", ("triton_",)),
    ("kda", ("chunk_", "state_scan", "state_terms", "tile_products", "ut_transform",
             "gate_cumsum", "kda", "wy_", "solve_tril", "delta_rule")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor_apply", "fusedoptimizer", "adam")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other aten")


def device_profile(fn: Callable[[], object], step_ms: float, top: int = 15,
                   trace: Path | None = None) -> dict:
    """One fn() call under torch.profiler: its `top` largest kernels by device time, the device
    time of each kernel class (KERNEL_CLASSES) with each share of step_ms, and the `top` largest
    kernels of each class. trace: also write the chrome trace there, gzipped (where the idle
    time sits is read off its timeline).

    fn() runs twice under the profiler and only the second call is recorded: the first op after
    the profiler starts pays its setup on the host (3 ms in a d-512 MoE layer's first GEMM, H100,
    2026-12-07), which a trace of that call would show as the step's own.

    Only kernels count: profiler annotations (the optimizer's `Optimizer.step#...` range) also
    carry device time, but they span kernels already counted.
    """
    activity = torch.profiler.ProfilerActivity
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [activity.CPU] + ([activity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for _ in range(2):
            fn()
            sync()
            prof.step()
    if trace is not None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    events = [e for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and "#" not in e.key]
    kernels = sorted(({"kernel": e.key, "calls": e.count, "ms": e.device_time_total / 1e3,
                       "share": e.device_time_total / 1e3 / step_ms,
                       "class": kernel_class(e.key)} for e in events),
                     key=lambda r: -r["ms"])
    classes: dict[str, float] = {}
    for k in kernels:
        classes[k["class"]] = classes.get(k["class"], 0.0) + k["ms"]
    busy = sum(classes.values())
    by_class = [{"class": c, "ms": ms, "share": ms / step_ms,
                 "top": [k for k in kernels if k["class"] == c][:top]}
                for c, ms in sorted(classes.items(), key=lambda x: -x[1])]
    by_class.append({"class": "idle (step minus kernels)", "ms": step_ms - busy,
                     "share": 1 - busy / step_ms, "top": []})
    return {"top": kernels[:top], "by_class": by_class}
