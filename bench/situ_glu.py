"""SiTU-GLU benchmark: the Triton op against the PyTorch reference, eager and compiled.

    python bench/situ_glu.py                         # GPU: the MoE bench's expert blocks
    python bench/situ_glu.py --device cpu --shapes 4096,64   # smoke (the references)

h = SiTU_β1(a) ⊙ β2·tanh(b/β2) over [rows, hidden] bf16 blocks, the experts' (rows = tokens x
top-k) as bench/moe.py's shapes have them: 16,384 tokens at (hidden 256, k 4), (768, 8) and
(3072, 16). Rows:
  triton          titan_moe::situ_glu / situ_glu_bwd (`situ_glu` on eager CUDA)
  triton packed   titan_moe::situ_glu_packed / _bwd on ab = [a | b] (what the experts and the
                  dense blocks run: one GEMM writes both halves), ∂ab written as one tensor
  compiled naive  torch.compile(situ_glu_naive): Inductor's fusion of the reference
  eager naive     situ_glu_naive, what eager CUDA ran before the op
each timed forward (no grad) and forward+backward (median of --iters after --warmup), with GB/s
by the bytes each must move at least (N elements of s bytes: forward reads a, b and writes h,
3·N·s; backward also reads ∂h, a, b and writes ∂a, ∂b, 8·N·s in all) and as a share of the
measured device-copy bandwidth. Prints a table, writes JSON.
"""

import argparse
import json

import torch
from report import environment
from timing import copy_bandwidth, timed

from titan_moe.cli_args import non_negative, positive
from titan_moe.ops.situ_glu import situ_glu, situ_glu_naive, situ_glu_packed

SHAPES = "65536,256;131072,768;262144,3072"


def impls(device: str) -> dict:
    """name -> (function, whether it takes ab = [a | b] rather than a and b)."""
    found = {"compiled naive": (torch.compile(situ_glu_naive), False),
             "eager naive": (situ_glu_naive, False)}
    if device != "cuda":
        return found
    return {"triton": (situ_glu, False), "triton packed": (situ_glu_packed, True), **found}


def bench(impl, packed, shape, device, dtype, warmup, iters, bandwidth) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    a, b, dh = (torch.randn(shape, device=device, generator=gen).mul(3).to(dtype)
                for _ in range(3))
    inputs = (torch.cat([a, b], dim=-1),) if packed else (a, b)
    for t in inputs:
        t.requires_grad_()

    def fwd():
        with torch.no_grad():
            impl(*inputs)

    def fwd_bwd():
        torch.autograd.grad(impl(*inputs), inputs, dh)

    fwd_ms = timed(fwd, device, warmup, iters)
    fwd_bwd_ms = timed(fwd_bwd, device, warmup, iters)
    moved = a.numel() * a.element_size()
    fwd_gbps, fwd_bwd_gbps = 3 * moved / fwd_ms / 1e6, 8 * moved / fwd_bwd_ms / 1e6
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "fwd_gbps": fwd_gbps,
            "fwd_bwd_gbps": fwd_bwd_gbps, "fwd_roof": fwd_gbps / bandwidth,
            "fwd_bwd_roof": fwd_bwd_gbps / bandwidth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=SHAPES, help="rows,hidden;...")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--out", default="bench/situ_glu.json")
    opts = parser.parse_args()
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(opts.device)
    shapes = [tuple(int(v) for v in s.split(",")) for s in opts.shapes.split(";")]
    rows = []
    print(f"{'impl':<15} {'rows':>7} {'hidden':>6} {'fwd ms':>8} {'f+b ms':>8} {'f+b GB/s':>9} "
          f"{'roof':>5}")
    for shape in shapes:
        for name, (impl, packed) in impls(opts.device).items():
            r = {"impl": name, "shape": shape, **bench(impl, packed, shape, opts.device, dtype,
                                                       opts.warmup, opts.iters, bandwidth)}
            rows.append(r)
            print(f"{name:<15} {shape[0]:>7} {shape[1]:>6} {r['fwd_ms']:8.3f} "
                  f"{r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_gbps']:9.0f} {r['fwd_bwd_roof']:5.2f}",
                  flush=True)
    with open(opts.out, "w") as f:
        json.dump({**environment(), "dtype": str(dtype), "copy_gbps": bandwidth, "rows": rows},
                  f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
