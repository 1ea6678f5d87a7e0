"""Peak memory of a module's backward on CPU, from the profiler's allocation events: they see
Inductor's buffers as well as eager tensors, so a compiled module's backward is measured whole."""

import torch
from torch.profiler import ProfilerActivity, profile


def backward_peak(module: torch.nn.Module, tokens: int, dim: int, row_tokens: int = 0) -> int:
    """Peak bytes allocated above the start during module's backward over x [1, tokens, dim].

    With row_tokens, x is the first `tokens` positions of a [1, row_tokens, dim] row: its
    strides, which Dynamo guards on (the batch stride too), are then the same for every length,
    so a module compiled over slices of x compiles once for all lengths."""
    x = torch.randn(1, max(tokens, row_tokens), dim)[:, :tokens].detach().requires_grad_()
    module(x).sum().backward()  # compiles (once per shape)
    y = module(x)
    grad = torch.ones_like(y)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y.backward(grad)
    live = peak = 0
    for nbytes in allocation_events(prof):
        live += nbytes
        peak = max(peak, live)
    return peak


def allocation_events(prof: profile) -> list[int]:
    """The profiled allocations (+ bytes) and frees (- bytes), in time order."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]
