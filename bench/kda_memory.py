"""Peak memory of KDA forward+backward, ours and fla's, predicted on a host without a GPU.

    python bench/kda_memory.py                        # the KDA issue's five shapes
    python bench/kda_memory.py --shapes 1,4096,16,128

bench/kda.py measures `torch.cuda.max_memory_allocated` over a forward+backward after warm-up, with
the inputs, dO and the output alive; the gradients are returned (torch.autograd.grad). The same run
happens here on CPU tensors with every Triton launch stubbed out, so each op's Python allocates
exactly what it allocates on the GPU and no kernel runs; a dispatch mode (the memory plan's
`titan_moe.plan.op_workspace.LiveBytes`) adds up the bytes of every live storage and keeps the
largest sum. Our op's forward and backward bodies run as plain Python, under its own autograd (the
forward saves the inputs and hands what it keeps to the backward, which frees each buffer after the
op that last reads it, as the op's does): a custom op's body is hidden from a dispatch mode. fla-
core is pure Python plus Triton; installed, its `chunk_kda` (`safe_gate`, lower bound -5, g given
or `use_gate_in_kernel`) runs the same way. The caching allocator's 512-byte rounding is left out.
Checked against the H200: the op as it was on 2026-12-04 predicted 0.563 GiB at (1, 4096, 16, 128),
and bench/kda.py measured 0.5630 GiB.
Prints a table, writes JSON.
"""

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
import triton.runtime.autotuner
import triton.runtime.jit
from kda import G_MIN, ISSUE_SHAPES
from report import write_json

from titan_moe.plan.op_workspace import (
    LiveBytes,
    chunk_triton,
    kda_backward,
    kda_launches_skipped,
)


@contextlib.contextmanager
def no_triton_launches():
    """Every Triton kernel call (ours through wrap_triton; fla's plain, autotuned or heuristic)
    returns without running; everything around it runs."""
    def skip(*args, **kwargs):
        return None

    patched = [(triton.runtime.jit.JITFunction, "run"),
               (triton.runtime.autotuner.Autotuner, "run"),
               (triton.runtime.autotuner.Heuristics, "run")]
    saved = [getattr(owner, name) for owner, name in patched]
    try:
        for owner, name in patched:
            setattr(owner, name, skip)
        with kda_launches_skipped():
            yield
    finally:
        for (owner, name), value in zip(patched, saved, strict=True):
            setattr(owner, name, value)


class OursWithBodies(torch.autograd.Function):
    """Our op's autograd (forward saves the inputs and hands the buffers it keeps to the
    backward, `chunk_triton._backward`) with the triton_ops' Python bodies called directly."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias):
        ctx.scale = q.shape[-1] ** -0.5
        o, _, *kept = chunk_triton.chunk_kda_fwd._init_fn(
            q, k, v, g, beta, None, A_log, dt_bias, None, ctx.scale, G_MIN, False, True)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias)
        ctx.kept = list(kept)  # handed to the backward, as chunk_triton._setup_context does
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, A_log, dt_bias = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        grads = kda_backward((q, k, v, g, beta, None, A_log, dt_bias, None), kept, do,
                             ctx.scale, G_MIN)
        dq, dk, dv, dg, dbeta, _, dA_log, d_dt_bias = grads[:8]
        return dq, dk, dv, dg, dbeta, dA_log, d_dt_bias


def ours(q, k, v, g, beta, A_log=None, dt_bias=None) -> torch.Tensor:
    return OursWithBodies.apply(q, k, v, g, beta, A_log, dt_bias)


def fla(q, k, v, g, beta, A_log=None, dt_bias=None) -> torch.Tensor:
    from fla.ops.kda import chunk_kda

    gate = {} if A_log is None else {"use_gate_in_kernel": True, "A_log": A_log,
                                     "dt_bias": dt_bias}
    return chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=G_MIN, **gate)[0]


def predicted_peak(impl, shape: tuple[int, int, int, int], fused: bool) -> int:
    """Peak live bytes of bench/kda.py's forward+backward of impl after one warm-up call."""
    b, t, h, d = shape
    tracker = LiveBytes()
    with no_triton_launches(), tracker:
        # Values do not matter (no kernel runs), only what is allocated.
        q, k, v, g = (torch.empty(b, t, h, d, dtype=torch.bfloat16) for _ in range(4))
        beta = torch.empty(b, t, h, dtype=torch.bfloat16)
        gate = [torch.zeros(h), torch.zeros(h * d)] if fused else []
        tensors = [x.requires_grad_() for x in (q, k, v, g, beta, *gate)]
        grad = torch.empty_like(v)
        for _ in range(2):  # the second call, as timed: after a warm-up
            tracker.peak = tracker.now
            torch.autograd.grad(impl(*tensors), tensors, grad)
    return tracker.peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="B,T,H,D;...")
    parser.add_argument("--out", type=Path, default=Path("kda_memory.json"))
    opts = parser.parse_args(argv)
    impls = {"titan_moe": ours}
    if importlib.util.find_spec("fla") is not None:
        impls["fla"] = fla
    else:
        print("note: fla-core is not installed (pip install fla-core==0.6.0): ours only")
    rows = []
    print(f"{'(B, T, H, D)':<20} {'gate':<6} " + " ".join(f"{n + ' GiB':>13}" for n in impls)
          + (f" {'ours / fla':>10}" if "fla" in impls else ""))
    for spec in opts.shapes.split(";"):
        shape = tuple(int(v) for v in spec.split(","))
        for fused in (False, True):
            peaks = {name: predicted_peak(impl, shape, fused) / 2**30
                     for name, impl in impls.items()}
            rows.append({"shape": list(shape), "fused_gate": fused,
                         **{f"{name}_peak_gib": gib for name, gib in peaks.items()}})
            ratio = f" {peaks['titan_moe'] / peaks['fla']:>10.3f}" if "fla" in peaks else ""
            print(f"{str(shape):<20} {'fused' if fused else 'given':<6} "
                  + " ".join(f"{gib:>13.3f}" for gib in peaks.values()) + ratio, flush=True)
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
