"""AttnRes site benchmark: the Triton op against the PyTorch reference, eager and compiled.

    python bench/attn_res.py --out bench/attn_res.json     # H200: the proxy's site shapes
    python bench/attn_res.py --device cpu --tiny           # smoke run on CPU (no Triton row)

For each n in --sources (source 0 fp32, as the embedding's block is, the rest bf16; rows × d
from --rows/--dim, the proxy's B·T = 8192 and d = 2048) it times the site's mix
(`attn_res_mix`, fp32 out, without the site's cast back) forward and forward+backward, as the
median over --iters of CUDA-event times after --warmup calls, for:

    triton         titan_moe.ops.attn_res.attn_res_mix_triton (the op the model runs on CUDA)
    compiled       torch.compile(attn_res_mix_naive, fullgraph=True), no passes
    compiled+pass  the same with compile_passes' attn_res pass (the pre-op CUDA path)
    eager          attn_res_mix_naive

GB/s is by the compulsory bytes, the least any implementation must move (query, gain and the
per-row statistics are < 0.1% and not counted), with S = Σ_i bytes(V_i) = rows·d·Σ_i elem_i:

    forward            S + 4·rows·d                 (sources read once, fp32 out written)
    forward+backward   3·S + 12·rows·d              (+ sources read again, fp32 dL/dout read,
                                                     a gradient per source written)

and "roof" is that GB/s over the copy bandwidth measured in the same run (a 1 GiB device copy,
read + write; ~4.0 TB/s on the H200). Prints a table, writes JSON (--out).
"""

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from report import write_json
from timing import copy_bandwidth, event_timed

from compile_passes.registry import inductor_options
from titan_moe.cli_args import non_negative, positive
from titan_moe.ops.attn_res import attn_res_mix_naive, attn_res_mix_triton

EPS = 1e-6


def site_bytes(rows: int, dim: int, dtypes: list[torch.dtype], backward: bool) -> float:
    sources = rows * dim * sum(torch.finfo(d).bits // 8 for d in dtypes)
    return 3 * sources + 12 * rows * dim if backward else sources + 4 * rows * dim


def make_inputs(rows: int, dim: int, dtypes: list[torch.dtype], device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    sources = [torch.randn(rows, dim, device=device, generator=gen).to(d).requires_grad_()
               for d in dtypes]
    query = (0.1 * torch.randn(dim, device=device, generator=gen)).requires_grad_()
    gain = torch.ones(dim, device=device, requires_grad=True)
    grad = torch.randn(rows, dim, device=device, generator=gen)
    return sources, query, gain, grad


def implementations(device: str) -> dict[str, Callable]:
    impls = {}
    if device == "cuda":
        impls["triton"] = attn_res_mix_triton
    impls["compiled"] = torch.compile(attn_res_mix_naive, fullgraph=True)
    impls["compiled+pass"] = torch.compile(attn_res_mix_naive, fullgraph=True,
                                           options=inductor_options(["attn_res"]))
    impls["eager"] = attn_res_mix_naive
    return impls


def bench(fn: Callable, rows, dim, dtypes, device, warmup, iters, bandwidth) -> dict:
    sources, query, gain, grad = make_inputs(rows, dim, dtypes, device)
    params = [*sources, query, gain]

    def fwd():
        with torch.no_grad():
            fn(sources, query, gain, EPS)

    def fwd_bwd():
        out = fn(sources, query, gain, EPS)
        torch.autograd.grad(out, params, grad)

    result = {}
    for name, call, backward in (("fwd", fwd, False), ("fwd_bwd", fwd_bwd, True)):
        ms = event_timed(call, device, warmup, iters)
        gbps = site_bytes(rows, dim, dtypes, backward) / ms / 1e6
        result.update({f"{name}_ms": ms, f"{name}_gbps": gbps, f"{name}_roof": gbps / bandwidth})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=positive, default=8192, help="B·T, the rows of a source")
    parser.add_argument("--dim", type=positive, default=2048)
    parser.add_argument("--sources", default="2,5,9", help="source counts n, comma-separated")
    parser.add_argument("--warmup", type=non_negative, default=5)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--tiny", action="store_true", help="rows 64, d 96 (a CPU smoke run)")
    parser.add_argument("--impls", nargs="*", help="time only these (triton, compiled, "
                        "compiled+pass, eager)")
    parser.add_argument("--out", default="bench/attn_res.json")
    opts = parser.parse_args()
    if opts.tiny:
        opts.rows, opts.dim = 64, 96
    counts = [int(v) for v in opts.sources.split(",")]
    if not all(1 <= n <= 9 for n in counts):
        parser.error(f"--sources: each n must be in 1..9, got {counts}")
    impls = implementations(opts.device)
    if opts.impls:
        unknown = set(opts.impls) - set(impls)
        if unknown:
            parser.error(f"--impls: {sorted(unknown)} not available here; allowed {list(impls)}")
        impls = {k: v for k, v in impls.items() if k in opts.impls}

    bandwidth = copy_bandwidth(opts.device)
    print(f"measured copy bandwidth (roofline): {bandwidth:.0f} GB/s")
    print(f"rows {opts.rows}, d {opts.dim}; source 0 fp32, the rest bf16")
    print(f"{'impl':<14} {'n':>2} {'fwd ms':>8} {'GB/s':>6} {'roof':>5} "
          f"{'f+b ms':>8} {'GB/s':>6} {'roof':>5}")
    rows = []
    for n in counts:
        dtypes = [torch.float32] + [torch.bfloat16] * (n - 1)
        for name, fn in impls.items():
            torch._dynamo.reset()  # a fresh compile per n: no recompile limit, no stale guards
            r = bench(fn, opts.rows, opts.dim, dtypes, opts.device, opts.warmup, opts.iters,
                      bandwidth)
            rows.append({"impl": name, "n": n, "rows": opts.rows, "dim": opts.dim,
                         "copy_gbps": bandwidth, **r})
            print(f"{name:<14} {n:>2} {r['fwd_ms']:>8.3f} {r['fwd_gbps']:>6.0f} "
                  f"{r['fwd_roof']:>5.2f} {r['fwd_bwd_ms']:>8.3f} {r['fwd_bwd_gbps']:>6.0f} "
                  f"{r['fwd_bwd_roof']:>5.2f}", flush=True)
    for n in counts:
        ms = {r["impl"]: r["fwd_bwd_ms"] for r in rows if r["n"] == n}
        if "triton" in ms and "compiled" in ms:
            print(f"n={n}: triton forward+backward {ms['compiled'] / ms['triton']:.2f}x the "
                  f"speed of compiled")
    write_json(Path(opts.out), opts, rows)


if __name__ == "__main__":
    main()
