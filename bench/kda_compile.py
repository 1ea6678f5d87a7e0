"""Cold compile time of each KDA Triton kernel for the H200 (sm_90), measured on the host CPU.

    python bench/kda_compile.py                  # the proxy layer's launch: bf16, docs, fused gate
    python bench/kda_compile.py --dtype float32  # fp32 inputs (the IEEE fp32 GEMM path)

Triton compiles ahead of time for a named target with no GPU present (ptxas ships with Triton),
so the cost that delays a cold first step — each kernel's JIT, dominated by its unrolled loops —
can be measured and cut on any machine. The launches are the op's own: chunk_kda_fwd and the
backward autograd runs run on CPU tensors with the kernel launcher replaced by a recorder, and each
recorded launch (arguments typed as the launcher types them: tensors by dtype, ints i32, Python
floats fp32) is compiled once into an empty Triton cache. Prints a table (seconds, PTX and LLVM
IR size, shared memory, and ptxas's own count of registers and spill bytes a thread: a spilling
kernel keeps its tiles in local memory, which no tile choice on the GPU can hide), writes JSON.
Figures are this host's CPU, not the GPU machine's; compare kernels and variants within one run.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from report import write_json
from triton.backends.compiler import GPUTarget
from triton_static import recorded_launches, resource_usage, source

from titan_moe.cli_args import positive
from titan_moe.ops.kda import chunk_triton
from titan_moe.plan.op_workspace import kda_backward


def forward_backward(inputs: tuple, d: int) -> None:
    """One forward and backward of the op's bodies, as autograd runs them (the forward keeps
    its buffers for the backward, chunk_triton._backward): inputs are (q, k, v, g, beta, doc,
    A_log, dt_bias, initial_state)."""
    _, _, *kept = chunk_triton.chunk_kda_fwd._init_fn(*inputs, d**-0.5, -5.0, False, True)
    kda_backward(inputs, kept, torch.zeros_like(inputs[2]), d**-0.5)


def record_launches(batch: int, seq_len: int, heads: int, d: int, dtype: torch.dtype,
                    docs: bool, fused: bool) -> list[tuple]:
    """(kernel, grid, positional args, keyword args) of every launch of one forward and
    backward."""
    shape = (batch, seq_len, heads, d)
    q, k, v, g = (torch.zeros(shape, dtype=dtype) for _ in range(4))
    beta = torch.zeros(shape[:3], dtype=dtype)
    doc = torch.zeros(shape[:2], dtype=torch.int32) if docs else None
    A_log, dt_bias = (torch.zeros(heads), torch.zeros(heads * d)) if fused else (None, None)
    common = (q, k, v, g, beta, doc, A_log, dt_bias, None)
    return recorded_launches(chunk_triton, lambda: forward_backward(common, d))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--heads", type=positive, default=16)
    parser.add_argument("--head-dim", type=positive, default=128)
    parser.add_argument("--no-docs", action="store_true", help="one document a row")
    parser.add_argument("--no-fused-gate", action="store_true", help="g given, not g_raw")
    parser.add_argument("--arch", type=positive, default=90, help="CUDA compute capability")
    parser.add_argument("--out", type=Path, default=Path("kda_compile.json"))
    opts = parser.parse_args(argv)
    launches = record_launches(1, 256, opts.heads, opts.head_dim, getattr(torch, opts.dtype),
                               not opts.no_docs, not opts.no_fused_gate)
    target = GPUTarget("cuda", opts.arch, 32)
    rows = []
    with tempfile.TemporaryDirectory() as cache:  # cold: nothing compiled before
        triton.knobs.cache.dir = cache
        for kernel, _, args, kwargs in launches:
            src, options = source(kernel, args, dict(kwargs))
            start = time.perf_counter()
            compiled = triton.compile(src, target=target, options=options)
            rows.append({"kernel": kernel.fn.__name__, "seconds": time.perf_counter() - start,
                         "ptx_kb": len(compiled.asm["ptx"]) / 1e3,
                         "llir_kb": len(compiled.asm["llir"]) / 1e3,
                         "shared_kb": compiled.metadata.shared / 1e3, **options,
                         **resource_usage(compiled.asm["ptx"], opts.arch)})
            row = rows[-1]
            print(f"{row['kernel']:<28} {row['seconds']:7.1f} s  PTX {row['ptx_kb']:6.0f} kB  "
                  f"LLIR {row['llir_kb']:6.0f} kB  shared {row['shared_kb']:5.1f} kB  "
                  f"regs {row['registers']:4d}  spills {row['spill_bytes']:6d} B", flush=True)
    print(f"{'total':<28} {sum(r['seconds'] for r in rows):7.1f} s (sm_{opts.arch}, "
          f"{opts.dtype}, H {opts.heads}, D {opts.head_dim}, docs {not opts.no_docs}, "
          f"fused gate {not opts.no_fused_gate}; this host's CPU)")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
