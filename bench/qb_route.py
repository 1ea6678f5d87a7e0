"""QB routing benchmark: our qb_route op against torch.topk + a scatter histogram, given logits.

    python bench/qb_route.py              # H200: T 16384, E 896, k 16, d 7168 (target: op 0.2 ms)
    python bench/qb_route.py --static     # any host: each launch shape compiled for sm_90

At --shape (T, E, k, d) and fp32 logits it times (CUDA events, median of --iters after --warmup):
  op            titan_moe::qb_route at its own launch shape and default counting (σ,
                top-(k+1), weights, the load and the QB histogram; with the share of rows it
                picks twice, see `op all keys`), called
                eagerly (the host's launch cost included, as an eager step pays it) and graphed
                (its call captured in a CUDA graph and replayed: device time alone, as the
                CUDA-graphed step pays it);
  op atomic     the histogram counted with relaxed global atomics in the routing kernel;
  op shared     the kernel writing each token's cutoff instead, binned and counted by
                count_bins in shared memory (with [T, E] int16 bins written and read instead:
                0.268 ms graphed against the atomics' 0.235 on the H200, 2026-12-06), each
                after checking its outputs equal the reference's;
  count_bins    the shared-memory counting kernel alone, on the logits and their cutoffs;
  op no hist    the op without the histogram and the load (what inference runs): the
                difference to `op` is what counting the histogram costs (eager and graphed);
  op all keys   the op's k+1 picks over every key of a row, not first over each lane's 4
                largest (the default at 512 to 1024 columns; 3,072 against 4,640 SASS a row, sm_90),
                after checking its outputs equal the op's (eager and graphed);
  op BTxW       the same kernel at BLOCK_T x num_warps from --launch-shapes, after checking that
                its outputs equal the op's bit for bit (eager and graphed);
  op rN         the op's launch with ptxas capped at N registers a thread (--maxnreg): fewer
                registers, more rows resident an SM (at 96, 21 warps an SM against 12: only
                4% faster graphed on the H200, 2026-12-05);
  torch         σ + torch.topk(k+1) + renormalised weights + the scatter histogram (qb_histogram),
                what the op replaces;
  gemm+σ        the router GEMM x [T, d] @ W^T in fp32, and σ;
  split gemm+σ  the router's default GEMM of bf16 x (ops/split_bf16_linear.py: two bf16 GEMMs
                against W's high and low bf16 parts, fp32 output), and σ;
  router        the whole Router forward (GEMM, op, statistics) on bf16 x, as mixed precision
                gives it: its default split_bf16 GEMM, and with router_gemm "fp32" (router fp32).
The floor is the op's compulsory bytes (logits read, ids and weights written, the histogram
zeroed and counted) over the measured copy bandwidth. --static compiles each launch shape for
--arch with no GPU (Triton ships ptxas and nvdisasm) and reports registers, spills, barriers and
SASS instructions a token row: the kernel has no runtime loop, so that is what a warp issues per
row, a GPU-free proxy for the op's issue-bound time (where the op first picks among each lane's
4 largest keys, the count includes the rarely run picks over every key: 5,656 at E 896, of which
a row issues 3,072 when it needs no second pick). Prints a table and writes JSON (--out).
"""

import argparse
import importlib
import sys
from pathlib import Path

import torch
import triton
from report import write_json
from timing import copy_bandwidth, event_timed, graphed_ms

from titan_moe.cli_args import non_negative, positive
from titan_moe.model.router import Router
from titan_moe.ops.router import qb_route
from titan_moe.ops.router.bin_counts import count_bins
from titan_moe.ops.router.histogram import qb_histogram
from titan_moe.ops.split_bf16_linear import split_bf16_linear

# The package exports the op under the module's name, so import the module by its path.
qb_module = importlib.import_module("titan_moe.ops.router.qb_route_triton")
N_BINS = 1000


def launch_shapes(spec: str) -> list[tuple[int, int]]:
    """"BT,W;BT,W" -> [(BLOCK_T, num_warps)], each a power of two."""
    shapes = [tuple(int(v) for v in item.split(",")) for item in spec.split(";") if item]
    for shape in shapes:
        if len(shape) != 2 or any(v < 1 or v & (v - 1) for v in shape):
            raise argparse.ArgumentTypeError(
                f"--launch-shapes: each item is BLOCK_T,num_warps, both powers of two; got {shape}")
    return shapes


def static_row(tokens: int, experts: int, k: int, shape: tuple[int, int], arch: int,
               maxnreg: int | None = None) -> dict:
    """Registers, spills, barriers and SASS instructions a token row of one launch shape (with
    ptxas capped at maxnreg registers a thread, if given)."""
    from triton.backends.compiler import GPUTarget
    from triton_static import recorded_launches, resource_usage, sass_opcodes, source

    logits, bias = torch.zeros(tokens, experts), torch.zeros(experts)
    (kernel, _, args, kwargs), = recorded_launches(qb_module, lambda: qb_module.launch_qb_route(
        logits, bias, None, k, 1.0, N_BINS, True, shape))
    # Recorded on CPU tensors; compile what CUDA runs (libdevice's expf, as torch.sigmoid).
    src, options = source(kernel, args, {**kwargs, "LIBDEVICE": True})
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    opcodes = sass_opcodes(compiled.asm["cubin"])
    block_t, num_warps = shape
    return {**resource_usage(compiled.asm["ptx"], arch), "barriers": opcodes["BAR"],
            "sass_per_row": sum(opcodes.values()) * num_warps / block_t}


def op_bytes(tokens: int, experts: int, k: int) -> int:
    """Logits read, ids (int64) and weights (fp32) written, the histogram zeroed and counted."""
    return tokens * experts * 4 + tokens * k * 12 + 2 * experts * N_BINS * 4


def repicked_share(logits: torch.Tensor, bias: torch.Tensor, k: int) -> float:
    """The share of rows where some lane (columns // 4 % 32, as the kernel loads them) holds more
    than 4 of the top k + 1, which the op picks again over every key (ties aside): 0.33% for
    i.i.d. logits at E 896, k 16."""
    ids = (torch.sigmoid(logits) + bias).topk(k + 1).indices
    lanes = ids // 4 % 32
    counts = torch.zeros(len(ids), 32, device=ids.device).scatter_add_(
        1, lanes, torch.ones_like(lanes, dtype=torch.float))
    return (counts.max(1).values > 4).float().mean().item()


def timed_rows(tokens, experts, k, d, shapes, caps, warmup, iters) -> list[dict]:
    router = Router(d, experts, k).cuda().train()
    router.init_weights(0.02)
    x = torch.randn(tokens, d, device="cuda")
    logits = x @ router.weight.t()
    bias = router.expert_bias
    want = qb_route(logits, bias, k)

    def torch_route():
        s = torch.sigmoid(logits)
        vals, ids = torch.topk(s + bias, k + 1)
        chosen = s.gather(-1, ids[:, :k])
        return chosen / chosen.sum(-1, keepdim=True), qb_histogram(s, vals[:, k], bias)

    def op():
        return qb_route(logits, bias, k)
    rows = [{"impl": "op", "launch": list(qb_module.launch_shape(experts)[::2]), "equal": True,
             "counting": qb_module.default_counting(logits, N_BINS),
             "repicked_rows": repicked_share(logits, bias, k),
             "ms": event_timed(op, "cuda", warmup, iters),
             "graphed_ms": graphed_ms(op, warmup, iters)}]
    for counting in qb_module.COUNTING:
        def counted(counting=counting):
            return qb_module.launch_qb_route(logits, bias, None, k, 1.0, N_BINS, True,
                                             counting=counting)
        rows.append({"impl": f"op {counting}", "equal": all(
            torch.equal(g, w) for g, w in zip(counted(), want, strict=True)),
            "ms": event_timed(counted, "cuda", warmup, iters),
            "graphed_ms": graphed_ms(counted, warmup, iters)})
    alpha = torch.topk(torch.sigmoid(logits) + bias, k + 1).values[:, k]

    def counts():
        return count_bins(logits, bias, alpha, N_BINS)
    rows.append({"impl": "count_bins", "graphed_ms": graphed_ms(counts, warmup, iters),
                 "ms": event_timed(counts, "cuda", warmup, iters)})

    def no_hist():
        return qb_route(logits, bias, k, with_histogram=False)
    rows.append({"impl": "op no hist", "ms": event_timed(no_hist, "cuda", warmup, iters),
                 "graphed_ms": graphed_ms(no_hist, warmup, iters)})
    variants = [("op all keys", {"lane_top4": False})]
    variants += [(f"op {s[0]}x{s[1]}", {"block_t_and_warps": s}) for s in shapes]
    variants += [(f"op r{n}", {"maxnreg": n}) for n in caps]
    for name, launch_args in variants:
        def launch(launch_args=launch_args):
            return qb_module.launch_qb_route(logits, bias, None, k, 1.0, N_BINS, True,
                                             **launch_args)
        equal = all(torch.equal(g, w) for g, w in zip(launch(), want, strict=True))
        rows.append({"impl": name, **launch_args, "equal": equal,
                     "ms": event_timed(launch, "cuda", warmup, iters),
                     "graphed_ms": graphed_ms(launch, warmup, iters)})
    rows.append({"impl": "torch", "ms": event_timed(torch_route, "cuda", warmup, iters)})
    rows.append({"impl": "gemm+σ", "ms": event_timed(
        lambda: torch.sigmoid(x @ router.weight.t()), "cuda", warmup, iters)})
    x_bf16 = x.bfloat16()
    rows.append({"impl": "split gemm+σ", "ms": event_timed(
        lambda: torch.sigmoid(split_bf16_linear(x_bf16, router.weight)), "cuda", warmup, iters)})
    rows.append({"impl": "router", "ms": event_timed(lambda: router(x_bf16), "cuda", warmup,
                                                     iters)})
    router_fp32 = Router(d, experts, k, gemm="fp32").cuda().train()
    router_fp32.load_state_dict(router.state_dict())
    rows.append({"impl": "router fp32", "ms": event_timed(lambda: router_fp32(x_bf16), "cuda",
                                                          warmup, iters)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384,896,16,7168", help="T,E,k,d")
    parser.add_argument("--launch-shapes", type=launch_shapes, default="1,1;2,1;2,2;4,4;4,8",
                        help="BLOCK_T,num_warps;... compared with the op's own")
    parser.add_argument("--maxnreg", type=lambda v: [int(n) for n in v.split(",") if n],
                        default="168,128,96",
                        help="register caps for the op's launch (timed, or compiled with --static)")
    parser.add_argument("--static", action="store_true",
                        help="compile each launch shape for --arch (no GPU needed), no timing")
    parser.add_argument("--arch", type=positive, default=90, help="CUDA compute capability")
    parser.add_argument("--warmup", type=non_negative, default=5)
    parser.add_argument("--iters", type=positive, default=50)
    parser.add_argument("--out", type=Path, default=Path("qb_route.json"))
    opts = parser.parse_args(argv)
    tokens, experts, k, d = (int(v) for v in opts.shape.split(","))
    block_t, _, num_warps = qb_module.launch_shape(experts)
    others = [s for s in opts.launch_shapes if s != (block_t, num_warps)]
    rows = []
    if opts.static:
        print(f"T {tokens}, E {experts}, k {k}: launch shapes compiled for sm_{opts.arch} "
              f"(the op's own first)")
        print(f"{'launch':<8} {'regs':>5} {'spill B':>8} {'BAR':>5} {'SASS/row':>9}")
        own = (block_t, num_warps)
        variants = [(f"{s[0]}x{s[1]}", s, None) for s in [own, *others]]
        variants += [(f"{own[0]}x{own[1]} r{n}", own, n) for n in opts.maxnreg]
        for name, shape, cap in variants:
            row = {"launch": list(shape), "maxnreg": cap,
                   **static_row(tokens, experts, k, shape, opts.arch, cap)}
            rows.append(row)
            print(f"{name:<8} {row['registers']:5d} {row['spill_bytes']:8d} "
                  f"{row['barriers']:5d} {row['sass_per_row']:9.0f}", flush=True)
    elif not torch.cuda.is_available():
        parser.error("timing needs CUDA; --static compiles for the GPU on any host")
    else:
        floor_ms = op_bytes(tokens, experts, k) / copy_bandwidth("cuda") / 1e6
        rows = timed_rows(tokens, experts, k, d, others, opts.maxnreg, opts.warmup, opts.iters)
        print(f"T {tokens}, E {experts}, k {k}, d {d}, fp32 logits; op floor {floor_ms:.3f} ms; "
              f"op counting {rows[0]['counting']}")
        print(f"{'impl':<10} {'ms':>8} {'graphed':>8} {'x floor':>8} {'equal':>6}")
        for row in rows:
            row["floor_ms"] = floor_ms
            graphed = f"{row['graphed_ms']:8.3f}" if "graphed_ms" in row else f"{'':8}"
            print(f"{row['impl']:<10} {row['ms']:8.3f} {graphed} {row['ms'] / floor_ms:8.1f} "
                  f"{str(row.get('equal', '')):>6}")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
