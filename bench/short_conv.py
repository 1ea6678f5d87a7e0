"""Short-conv benchmark: the Triton op against the PyTorch reference, compiled and eager.

    python bench/short_conv.py                      # H200: B 2, T 4096, C 2048, docs of 2048
    python bench/short_conv.py --compile-times      # cold sm_90 compile of each kernel, host CPU
    python bench/short_conv.py --device cpu --seq-len 256 --channels 256   # smoke (references)

The KDA layer's glue: y = SiLU(causal depthwise conv, K taps, restarting at document starts),
then per head of --head-dims channels an L2 norm (0: none, the v path). x is bf16 (the
projections' dtype under autocast), the weight fp32 [C, K]. Rows, for each head_dim:
  triton          titan_moe::short_conv / short_conv_bwd (`short_conv` on CUDA)
  compiled naive  torch.compile(short_conv_naive), what Inductor makes of the reference
  eager naive     short_conv_naive
each timed forward (no grad) and forward+backward (median of --iters after --warmup, timing.py).
GB/s is by the bytes each must move at least, N = B·T·C elements of s bytes (bf16: 2):
  forward           x read, y written                 2·N·s + 4·B·T (doc ids) + 4·C·K (weight)
  forward+backward  plus x, dy read and dx written    5·N·s + 8·B·T + 12·C·K (weight, dweight)
and as a share of the measured device-copy bandwidth (the roofline). Prints a table, writes JSON.

--compile-times compiles each kernel of one forward and backward for sm_90 on this host (as
bench/kda_compile.py does, into an empty cache): the cold JIT a first training step waits for.
"""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import triton
from report import environment
from timing import copy_bandwidth, timed

from titan_moe.cli_args import non_negative, positive
from titan_moe.ops.short_conv import short_conv, short_conv_naive


def compulsory_bytes(batch: int, seq_len: int, channels: int, taps: int, elem: int,
                     backward: bool) -> float:
    n = batch * seq_len * channels
    if backward:
        return 5 * n * elem + 8 * batch * seq_len + 12 * channels * taps
    return 2 * n * elem + 4 * batch * seq_len + 4 * channels * taps


def inputs(batch, seq_len, channels, taps, doc_len, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq_len, channels, device=device, generator=gen).to(dtype)
    weight = torch.rand(channels, taps, device=device, generator=gen) - 0.5
    dy = torch.randn(batch, seq_len, channels, device=device, generator=gen).to(dtype)
    doc = None
    if doc_len:
        doc = (torch.arange(seq_len, device=device) // doc_len).to(torch.int32)
        doc = doc.expand(batch, -1).contiguous()
    return x.requires_grad_(), weight.requires_grad_(), dy, doc


def impls(device: str) -> dict[str, Callable]:
    found = {"compiled naive": torch.compile(short_conv_naive), "eager naive": short_conv_naive}
    if device == "cuda":
        found = {"triton": short_conv, **found}
    return found


def bench(impl, shape, head_dim, doc_len, device, dtype, warmup, iters, bandwidth) -> dict:
    batch, seq_len, channels, taps = shape
    x, weight, dy, doc = inputs(batch, seq_len, channels, taps, doc_len, device, dtype)
    head = head_dim or None

    def fwd():
        with torch.no_grad():
            impl(x, weight, doc, head)

    def fwd_bwd():
        impl(x, weight, doc, head).backward(dy)

    fwd_ms = timed(fwd, device, warmup, iters)
    fwd_bwd_ms = timed(fwd_bwd, device, warmup, iters)
    elem = x.element_size()
    fwd_gbps = compulsory_bytes(*shape, elem, False) / fwd_ms / 1e6
    fwd_bwd_gbps = compulsory_bytes(*shape, elem, True) / fwd_bwd_ms / 1e6
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "fwd_gbps": fwd_gbps,
            "fwd_bwd_gbps": fwd_bwd_gbps, "fwd_roof": fwd_gbps / bandwidth,
            "fwd_bwd_roof": fwd_bwd_gbps / bandwidth}


def compile_times(shape, head_dim: int, doc_len: int, arch: int) -> list[dict]:
    """Seconds to compile each kernel of one forward and backward for sm_<arch>, cold."""
    from triton.backends.compiler import GPUTarget
    from triton_static import recorded_launches, source

    kernels = sys.modules["titan_moe.ops.short_conv.short_conv_triton"]
    batch, seq_len, channels, taps = shape
    x, weight, dy, doc = inputs(batch, min(seq_len, 256), channels, taps, min(doc_len, 100),
                                "cpu", torch.bfloat16)

    def run():
        kernels.short_conv_triton._init_fn(x.detach(), weight.detach(), doc, head_dim)
        kernels.short_conv_bwd_triton._init_fn(dy, x.detach(), weight.detach(), doc, head_dim)

    launches = recorded_launches(kernels, run)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        triton.knobs.cache.dir = cache
        for kernel, _, args, kwargs in launches:
            src, options = source(kernel, args, dict(kwargs))
            start = time.perf_counter()
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            rows.append({"kernel": kernel.fn.__name__, "head_dim": head_dim,
                         "seconds": time.perf_counter() - start,
                         "ptx_kb": len(compiled.asm["ptx"]) / 1e3, **options})
            print(f"{rows[-1]['kernel']:<24} head_dim {head_dim:>4} {rows[-1]['seconds']:6.1f} s"
                  f"  PTX {rows[-1]['ptx_kb']:5.0f} kB", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=positive, default=2)
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--channels", type=positive, default=2048)
    parser.add_argument("--taps", type=positive, default=4, help="conv width K")
    parser.add_argument("--head-dims", default="128,0", help="per-head norm widths (0: none)")
    parser.add_argument("--doc-len", type=non_negative, default=2048,
                        help="tokens a document (0: one document a row)")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--compile-times", action="store_true",
                        help="only the cold compile time of each kernel for --arch, on this host")
    parser.add_argument("--arch", type=positive, default=90, help="CUDA compute capability")
    parser.add_argument("--out", default="bench/short_conv.json")
    opts = parser.parse_args()
    shape = (opts.batch, opts.seq_len, opts.channels, opts.taps)
    head_dims = [int(v) for v in opts.head_dims.split(",")]
    if opts.compile_times:
        rows = [r for h in head_dims for r in compile_times(shape, h, opts.doc_len, opts.arch)]
        with open(opts.out, "w") as f:
            json.dump({"environment": environment(), "arch": opts.arch, "compile": rows}, f,
                      indent=2)
        print(f"wrote {opts.out}")
        return
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(opts.device)
    print(f"measured copy bandwidth (roofline): {bandwidth:.0f} GB/s")
    print(f"{'impl':<15} {'head_dim':>8} {'fwd ms':>8} {'GB/s':>6} {'roof':>5} "
          f"{'f+b ms':>8} {'GB/s':>6} {'roof':>5}")
    rows = []
    for head_dim in head_dims:
        for name, impl in impls(opts.device).items():
            r = bench(impl, shape, head_dim, opts.doc_len, opts.device, dtype, opts.warmup,
                      opts.iters, bandwidth)
            rows.append({"impl": name, "head_dim": head_dim, **r})
            print(f"{name:<15} {head_dim:>8} {r['fwd_ms']:>8.3f} {r['fwd_gbps']:>6.0f} "
                  f"{r['fwd_roof']:>5.2f} {r['fwd_bwd_ms']:>8.3f} {r['fwd_bwd_gbps']:>6.0f} "
                  f"{r['fwd_bwd_roof']:>5.2f}", flush=True)
    with open(opts.out, "w") as f:
        json.dump({"environment": environment(), "dtype": str(dtype), "shape": shape,
                   "doc_len": opts.doc_len, "copy_gbps": bandwidth, "rows": rows}, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
