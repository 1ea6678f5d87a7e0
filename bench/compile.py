"""Each of our Inductor passes on its own block: kernels launched and bytes moved, with and without.

    python bench/compile.py                    # CUDA: proxy widths, bf16 sources / activations
    python bench/compile.py --tiny             # smoke run on CPU (tiny shapes, fp32)

For every pass the block it targets is compiled twice (forward + backward, fullgraph), once with
only that pass installed and once with none, through compile_passes.inspect (caches off, so the
passes always run). Reported per compile: the pass's matches, Inductor's generated kernels and
their launches per forward+backward (plus extern library calls, e.g. matmuls), the bytes its
scheduler estimates the kernels read and write (`torch._inductor.metrics.num_bytes_accessed`,
from `GraphLowering.count_bytes`), and the median forward+backward time of the compiled block.

    situ_glu   the dense SiTU-GLU MLP (two matmuls in, the gated unit, one matmul out)
    attn_res   an AttnRes site over --sources residual sources
    kda_gate   the KDA gate + chunk-local cumsum of the PyTorch KDA path (on CUDA the Triton op
               fuses them itself, so the pass is measured on that path's own ops)

Prints a table and writes JSON (--out).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
from report import write_json
from timing import timed

from compile_passes.inspect import inspect_compile
from compile_passes.kda_gate_cumsum_fusion import _search as gate_then_chunk_cumsum
from compile_passes.registry import PASS_NAMES, inductor_options
from titan_moe.cli_args import in_range, non_negative, positive
from titan_moe.model.args import get_flavor
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.situ_glu import SiTUGLU


class GateCumsum(nn.Module):
    """The KDA gate and its chunk-local cumsum as chunk_kda_torch computes them."""

    def __init__(self, heads: int, head_dim: int, g_min: float) -> None:
        super().__init__()
        self.g_min = g_min
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.randn(heads * head_dim) * 0.1)

    def forward(self, g_raw: torch.Tensor) -> torch.Tensor:
        return gate_then_chunk_cumsum(g_raw, self.A_log, self.dt_bias, self.g_min)


class Sources(nn.Module):
    """An AttnRes site called on a list of sources (inspect_compile passes positional inputs)."""

    def __init__(self, site: AttnResSite) -> None:
        super().__init__()
        self.site = site

    def forward(self, *sources: torch.Tensor) -> torch.Tensor:
        return self.site(list(sources))


def build(name: str, opts, device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple]:
    args = get_flavor(opts.flavor)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    tokens = (opts.batch, opts.seq_len)
    if name == "situ_glu":
        module: nn.Module = SiTUGLU(args.dim, args.dense_hidden, args.situ_beta1, args.situ_beta2)
        module.init_weights(args.init_std, args.init_std)
        return module.to(device, dtype), (rand(*tokens, args.dim),)
    if name == "attn_res":
        site = AttnResSite(args.dim, args.attn_res_eps)
        with torch.no_grad():
            site.query.normal_(0, 0.5)
        return Sources(site).to(device), tuple(rand(*tokens, args.dim)
                                               for _ in range(opts.sources))
    module = GateCumsum(args.n_heads, args.head_dim, args.kda_g_min).to(device)
    # The gate runs in fp32 on the PyTorch path whatever the activations are.
    g_raw = torch.randn(*tokens, args.n_heads, args.head_dim, generator=g).to(device)
    return module, (g_raw.requires_grad_(),)


def measure(name: str, passes: list[str], opts, device: str, dtype: torch.dtype) -> dict:
    module, inputs = build(name, opts, device, dtype)
    torch._inductor.metrics.reset()
    result = inspect_compile(module, inputs, steps=1, passes=passes)
    generated = [k for k in result.kernels if k.kind == "generated"]
    extern = [k for k in result.kernels if k.kind == "extern"]
    compiled = torch.compile(module, fullgraph=True, options=inductor_options(passes) or None)

    def step() -> None:
        out = compiled(*inputs)
        out.float().square().mean().backward()

    ms = timed(step, device, opts.warmup, opts.iters)
    torch._dynamo.reset()
    return {
        "pass": name, "with_pass": bool(passes), "device": device, "dtype": str(dtype),
        "matches": result.pass_matches.get(name, 0),
        "generated_kernels": len(generated),
        "kernel_launches": sum(k.launches for k in generated),
        "extern_launches": sum(k.launches for k in extern),
        "bytes_accessed": int(torch._inductor.metrics.num_bytes_accessed),
        "graph_breaks": result.n_graph_breaks,
        "fwd_bwd_ms": ms,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: debug widths, 2 x 64 "
                        "tokens, fp32, one timed iteration")
    parser.add_argument("--flavor", default="proxy", choices=("debug", "proxy", "full"))
    parser.add_argument("--batch", type=positive, default=1)
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--sources", type=in_range(int, 2, 9), default=5,
                        help="AttnRes sources (2..9)")
    parser.add_argument("--passes", nargs="+", default=list(PASS_NAMES), choices=PASS_NAMES)
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=10)
    parser.add_argument("--out", type=Path, default=Path("compile.json"))
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.flavor, opts.batch, opts.seq_len, opts.warmup, opts.iters = "debug", 2, 64, 1, 1
    if opts.seq_len % 64:
        parser.error(f"--seq-len must be a multiple of the KDA chunk 64, got {opts.seq_len}")
    if not 2 <= opts.sources <= 9:
        parser.error(f"--sources must be in 2..9 (an AttnRes site's source count), got "
                     f"{opts.sources}")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    device = "cpu" if opts.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # Inductor only counts bytes when its metrics log is on.
    torch._logging.set_logs(inductor_metrics=True)
    rows = [measure(name, passes, opts, device, dtype)
            for name in opts.passes for passes in ([], [name])]
    torch._logging.set_logs()
    print(f"{'pass':<9} {'on':>3} {'match':>5} {'kernels':>7} {'launches':>8} {'extern':>6} "
          f"{'MB moved':>9} {'ms':>8}")
    for r in rows:
        print(f"{r['pass']:<9} {'yes' if r['with_pass'] else 'no':>3} {r['matches']:5d} "
              f"{r['generated_kernels']:7d} {r['kernel_launches']:8d} {r['extern_launches']:6d} "
              f"{r['bytes_accessed'] / 1e6:9.2f} {r['fwd_bwd_ms']:8.3f}")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
