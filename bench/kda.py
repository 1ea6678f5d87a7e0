"""KDA benchmark: our `chunk_kda` against fla-core 0.6.0 (`safe_gate=True, lower_bound=-5`).

    python bench/kda.py                                   # H200: the shapes of the KDA issue
    python bench/kda.py --device cpu --shapes 1,256,2,64  # smoke run on CPU (ours only)

For each (B, T, H, D) in bf16 it times forward and forward+backward (median of --iters after
--warmup) and reports TFLOP/s with Kimi Linear's count per head, 6TD² + 3TCD + TC² for the
forward (C = 64), tripled for forward+backward, plus the speed-up over fla and the peak memory
of forward+backward. Gates are drawn in (−5, 0], the model's range. Prints a table, writes JSON.
fla's first call at a new shape autotunes for minutes: keep ~/.triton/cache between runs.
"""

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from timing import timed

from titan_moe.ops.kda import CHUNK_SIZE, chunk_kda

ISSUE_SHAPES = "1,8192,16,128;2,16384,16,128;1,8192,96,128;8,4096,32,128;1,65536,16,128"


def forward_flops(b: int, t: int, h: int, d: int) -> float:
    return b * h * (6 * t * d * d + 3 * t * CHUNK_SIZE * d + t * CHUNK_SIZE * CHUNK_SIZE)


def inputs(b, t, h, d, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32, generator=gen)

    q = torch.nn.functional.normalize(rand(b, t, h, d), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rand(b, t, h, d), dim=-1).to(dtype)
    v = rand(b, t, h, d).to(dtype)
    g = (-5 * torch.sigmoid(rand(b, t, h, d))).to(dtype)
    beta = torch.sigmoid(rand(b, t, h)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def bench(impl: Callable, shape, device, dtype, warmup, iters) -> dict:
    tensors = inputs(*shape, device, dtype)
    grad = torch.randn_like(tensors[2])

    def fwd():
        with torch.no_grad():
            impl(*tensors)

    def fwd_bwd():
        impl(*tensors)[0].backward(grad)

    fwd_ms = timed(fwd, device, warmup, iters)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fwd_bwd_ms = timed(fwd_bwd, device, warmup, iters)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    flops = forward_flops(*shape)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
            "fwd_bwd_tflops": 3 * flops / fwd_bwd_ms / 1e9, "peak_gib": peak}


def fla_impl():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    return lambda q, k, v, g, beta: fla_chunk_kda(q, k, v, g, beta, safe_gate=True,
                                                  lower_bound=-5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="B,T,H,D;...")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench/kda.json")
    opts = parser.parse_args()
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    impls = {"titan_moe": chunk_kda}
    fla = fla_impl() if opts.device == "cuda" else None
    if fla is not None:
        impls["fla"] = fla
    else:
        print("note: fla-core (CUDA) not available here; timing ours only")
    rows = []
    print(f"{'impl':<10} {'B':>2} {'T':>6} {'H':>3} {'D':>4} {'fwd ms':>8} {'f+b ms':>8} "
          f"{'fwd TF/s':>9} {'f+b TF/s':>9} {'peak GiB':>9}")
    for text in opts.shapes.split(";"):
        shape = tuple(int(v) for v in text.split(","))
        for name, impl in impls.items():
            r = bench(impl, shape, opts.device, dtype, opts.warmup, opts.iters)
            rows.append({"impl": name, "shape": shape, **r})
            print(f"{name:<10} {shape[0]:>2} {shape[1]:>6} {shape[2]:>3} {shape[3]:>4} "
                  f"{r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>8.3f} {r['fwd_tflops']:>9.2f} "
                  f"{r['fwd_bwd_tflops']:>9.2f} {r['peak_gib']:>9.2f}")
    if fla is not None:
        ratios = [f["fwd_bwd_ms"] / o["fwd_bwd_ms"] for o, f in zip(rows[::2], rows[1::2],
                                                                     strict=True)]
        print(f"fwd+bwd speed-up over fla, geometric mean: "
              f"{statistics.geometric_mean(ratios):.2f}x")
    result = {"device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "rows": rows}
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
