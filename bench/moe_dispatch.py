"""MoE dispatch layout, dispatch and combine benchmark: the Triton ops against the PyTorch
reference, compiled and eager.

    python bench/moe_dispatch.py                  # H200: 8192 tokens, top-8 of 64, width 1024
    python bench/moe_dispatch.py --device cpu --tokens 512 --width 64     # smoke (references)

The LatentMoE layer's layout (each (token, slot) pair's row in the expert-grouped buffer, from
the router's expert ids), its copy of each token's latent row into its k expert groups
(dispatch) and the weighted sum of its k expert rows back (combine), with the layout of
`model/moe.py` (groups aligned to 8 rows). Rows, for each op:
  triton          titan_moe::dispatch_layout / moe_dispatch / moe_combine (the entry points on
                  CUDA)
  compiled naive  torch.compile of the reference, what Inductor makes of it
  eager naive     the reference
each timed forward (no grad) and forward+backward (the layout, integers, has no backward; median
of --iters after --warmup, CUDA events). GB/s is by the bytes each must move at least (N tokens,
P = N·k pairs, R buffer rows, d wide, s-byte rows, fp32 weights and u, int64 indices):
  layout    the pairs' experts read, dest and src written              16P + 8R
  dispatch  forward z read, grouped written            N·d·s + R·d·s + 8R
            + backward: the pairs' rows of dgrouped read, dz written    + P·d·s + N·d·s + 8P
  combine   forward the pairs' rows read, u written    P·d·s + 4N·d + 12P
            + backward: du and the rows read again, drows and dw written
                                                       + 4N·d + P·d·s + R·d·s + 4P + 8R
and as a share of the measured device-copy bandwidth (the roofline). Prints a table, writes
JSON (--out).
"""

import argparse
import json
from collections.abc import Callable

import torch
from report import environment
from timing import copy_bandwidth, event_timed

from titan_moe.cli_args import non_negative, positive
from titan_moe.ops.moe_dispatch import (
    dispatch_layout,
    dispatch_layout_naive,
    moe_combine,
    moe_combine_naive,
    moe_dispatch,
    moe_dispatch_naive,
)

GROUP_ALIGN = 8  # rows a group is padded to, the LatentMoE layer's default (model/moe.py)


def compulsory_bytes(op: str, n: int, pairs: int, rows: int, width: int, elem: int,
                     backward: bool) -> float:
    if op == "layout":
        return 16 * pairs + 8 * rows
    if op == "dispatch":
        fwd = n * width * elem + rows * width * elem + 8 * rows
        return fwd + (pairs * width * elem + n * width * elem + 8 * pairs if backward else 0)
    fwd = pairs * width * elem + 4 * n * width + 12 * pairs
    return fwd + (4 * n * width + pairs * width * elem + rows * width * elem + 4 * pairs
                  + 8 * rows if backward else 0)


def inputs(opts, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(opts.tokens, opts.experts, device=device, generator=gen)
    pair_expert = scores.topk(opts.top_k).indices.reshape(-1)
    dest, src, _ = dispatch_layout(pair_expert, opts.experts, GROUP_ALIGN)
    rows = src.numel()
    return {
        "pair_expert": pair_expert,
        "z": torch.randn(opts.tokens, opts.width, device=device, generator=gen).to(dtype),
        "expert_out": torch.randn(rows, opts.width, device=device, generator=gen).to(dtype),
        "weights": torch.rand(opts.tokens, opts.top_k, device=device, generator=gen),
        "dest": dest, "src": src,
        "du": torch.randn(opts.tokens, opts.width, device=device, generator=gen),
        "dgrouped": torch.randn(rows, opts.width, device=device, generator=gen).to(dtype),
    }


def impls(device: str, n_experts: int) -> dict[str, dict[str, Callable]]:
    """impl -> op -> fn(t, *args) of the tensors t that `inputs` makes."""
    def naive_layout(t):
        return dispatch_layout_naive(t["pair_expert"], n_experts, GROUP_ALIGN)

    def layout(t):
        return dispatch_layout(t["pair_expert"], n_experts, GROUP_ALIGN)

    def naive_dispatch(t, z):
        return moe_dispatch_naive(z, t["dest"], t["src"].numel(), t["weights"].shape[1])

    def naive_combine(t, rows, weights):
        return moe_combine_naive(rows, t["dest"], weights)

    def dispatch(t, z):
        return moe_dispatch(z, t["dest"], t["src"], t["weights"].shape[1])

    def combine(t, rows, weights):
        return moe_combine(rows, t["dest"], t["src"], weights)

    found = {"compiled naive": {"layout": torch.compile(naive_layout),
                                "dispatch": torch.compile(naive_dispatch),
                                "combine": torch.compile(naive_combine)},
             "eager naive": {"layout": naive_layout, "dispatch": naive_dispatch,
                             "combine": naive_combine}}
    if device == "cuda":
        found = {"triton": {"layout": layout, "dispatch": dispatch, "combine": combine}, **found}
    return found


def bench(fn: Callable, op: str, t: dict, opts, device: str) -> dict:
    sizes = (opts.tokens, t["dest"].numel(), t["src"].numel(), opts.width,
             t["z"].element_size())
    if op == "layout":
        fwd_ms = event_timed(lambda: fn(t), device, opts.warmup, opts.iters)
        return {"fwd_ms": fwd_ms, "fwd_bwd_ms": None,
                "fwd_gbps": compulsory_bytes(op, *sizes, False) / fwd_ms / 1e6,
                "fwd_bwd_gbps": None}
    if op == "dispatch":
        z = t["z"].detach().requires_grad_()
        args, grad = (z,), t["dgrouped"]
    else:
        rows = t["expert_out"].detach().requires_grad_()
        weights = t["weights"].detach().requires_grad_()
        args, grad = (rows, weights), t["du"]

    def fwd():
        with torch.no_grad():
            fn(t, *args)

    def fwd_bwd():
        fn(t, *args).backward(grad)

    fwd_ms = event_timed(fwd, device, opts.warmup, opts.iters)
    fwd_bwd_ms = event_timed(fwd_bwd, device, opts.warmup, opts.iters)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_gbps": compulsory_bytes(op, *sizes, False) / fwd_ms / 1e6,
            "fwd_bwd_gbps": compulsory_bytes(op, *sizes, True) / fwd_bwd_ms / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=positive, default=8192)
    parser.add_argument("--top-k", type=positive, default=8)
    parser.add_argument("--experts", type=positive, default=64)
    parser.add_argument("--width", type=positive, default=1024, help="latent width d")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--out", default="bench/moe_dispatch.json")
    opts = parser.parse_args()
    if opts.top_k > opts.experts:
        parser.error(f"--top-k must be <= --experts = {opts.experts}, got {opts.top_k}")
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(opts.device)
    tensors = inputs(opts, opts.device, dtype)
    print(f"measured copy bandwidth (roofline): {bandwidth:.0f} GB/s; {opts.tokens} tokens, "
          f"top-{opts.top_k} of {opts.experts}, width {opts.width}, "
          f"{tensors['src'].numel()} buffer rows")
    print(f"{'impl':<15} {'op':<9} {'fwd ms':>8} {'GB/s':>6} {'roof':>5} {'f+b ms':>8} "
          f"{'GB/s':>6} {'roof':>5}")
    rows = []
    for impl, ops in impls(opts.device, opts.experts).items():
        for op, fn in ops.items():
            r = {"impl": impl, "op": op, **bench(fn, op, tensors, opts, opts.device)}
            r["fwd_roof"] = r["fwd_gbps"] / bandwidth
            r["fwd_bwd_roof"] = None if r["fwd_bwd_ms"] is None else r["fwd_bwd_gbps"] / bandwidth
            rows.append(r)
            both = ("" if r["fwd_bwd_ms"] is None else
                    f" {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_gbps']:6.0f} {r['fwd_bwd_roof']:5.2f}")
            print(f"{impl:<15} {op:<9} {r['fwd_ms']:8.3f} {r['fwd_gbps']:6.0f} "
                  f"{r['fwd_roof']:5.2f}{both}", flush=True)
    with open(opts.out, "w") as f:
        json.dump({"environment": environment(), "args": vars(opts),
                   "copy_bandwidth_gbps": bandwidth, "rows": rows}, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
