"""What counting the QB histogram inside a program costs, compiled for sm_90 with no GPU: the
evidence behind keeping the op's one relaxed global atomic per (token, expert).

    python bench/qb_histogram_static.py            # T 16384, E 896, 1000 bins (K3's routing)

The op (qb_route_triton.py) counts hist[e, bin(alpha_t - s[t, e])] += 1 with 14.7M relaxed
global atomic adds at T 16384, E 896; on the H200 they cost 0.1 ms of the op's 0.251 ms (graphed;
0.152 ms without them). A variant whose programs own whole experts and count all T tokens locally
would issue no global atomic, but Triton offers one in-program counter, `tl.histogram`, and Triton
3.6 lowers it with warp ballots: each lane owns n_bins / 32 bins and, for every 32 elements a warp
holds, takes a `POPC` of a ballot mask for each of its bins. Its cost per element therefore grows
with the bins, n_bins / 32 POPC (16 a clock an SM on sm_90), against one `RED` for the atomic.
The other formulation, one-hot matrices into a tensor-core product (hist[e] = onehot(bin >> 5)^T
@ onehot(bin & 31)), spends 64 one-hot entries an element, each built in registers and staged
through shared memory for the product.

Each candidate below counts `elements` bins (it is the histogram part of the op only: the
variant would also re-read the logits, ~18 us, and recompute σ and the bin):
  atomic       one relaxed atomic add an element (the op's way);
  hist N       tl.histogram of the bins of one expert, N bins (the smallest power of two >= the
               op's 1000, and two smaller ones to show the scaling);
  hist E8xN    tl.histogram over 8 experts' flattened (expert, bin) index (8 x N bins);
  onehot-dot   the int8 one-hot product for one expert (32 x 32 = 1024 bins).
For each: registers, spills, shared memory, and per counted element the SASS instructions a lane
issues and the POPC among them, each the difference between two block sizes (the kernels have no
runtime loop, so what the SASS lists is what runs), hence free of the per-block fixed cost. From
them two lower bounds for the H200 at --shape: issue-bound (every SM issuing 4 warp instructions
a clock, which no kernel reaches) and POPC-bound.

--aggregation asks what "sum equal (expert, bin) pairs before the atomics" would save: on the
logits bench/qb_route.py times (the Router's init, x ~ N(0, 1), zero bias), the fraction of a
block of tokens' (expert, bin) pairs that are distinct, i.e. the atomics left, for each
--blocks size. Prints tables and writes JSON (--out).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from report import write_json
from triton.backends.compiler import GPUTarget
from triton_static import resource_usage, sass_opcodes, source

from titan_moe.cli_args import positive
from titan_moe.model.router import Router
from titan_moe.ops.router.histogram import qb_histogram, qb_range

H200_SMS = 132
H200_CLOCK_HZ = 1.98e9  # the SM clock read under load (device KINDS.md, 2026-10-28)
LANES_A_CLOCK = 4 * 32  # four schedulers, one warp instruction each a clock
POPC_A_CLOCK = 16  # CUDA programming guide, arithmetic throughput, compute capability 9.0
NUM_WARPS = 4


@triton.jit
def atomic_count_kernel(bins_ptr, hist_ptr, BLOCK: tl.constexpr, N_BINS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(hist_ptr + tl.load(bins_ptr + offs), 1, sem="relaxed")


@triton.jit
def histogram_count_kernel(bins_ptr, hist_ptr, BLOCK: tl.constexpr, N_BINS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    counts = tl.histogram(tl.load(bins_ptr + offs), N_BINS)
    bins = tl.arange(0, N_BINS)
    tl.store(hist_ptr + tl.program_id(0) * N_BINS + bins, counts)


@triton.jit
def onehot_dot_count_kernel(bins_ptr, hist_ptr, BLOCK: tl.constexpr, N_BINS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bins = tl.load(bins_ptr + offs)
    j = tl.arange(0, 32)
    high = ((bins[None, :] >> 5) == j[:, None]).to(tl.int8)
    low = ((bins[:, None] & 31) == j[None, :]).to(tl.int8)
    counts = tl.dot(high, low, out_dtype=tl.int32)
    tl.store(hist_ptr + tl.program_id(0) * N_BINS + j[:, None] * 32 + j[None, :], counts)


# name -> (kernel, bins, the two block sizes whose difference is the per-element cost)
CANDIDATES = {
    "atomic": (atomic_count_kernel, 1024, (1024, 2048)),
    "hist 256": (histogram_count_kernel, 256, (1024, 2048)),
    "hist 512": (histogram_count_kernel, 512, (1024, 2048)),
    "hist 1024": (histogram_count_kernel, 1024, (1024, 2048)),
    "hist E8x1024": (histogram_count_kernel, 8192, (1024, 2048)),
    "onehot-dot": (onehot_dot_count_kernel, 1024, (128, 256)),
}


def compiled_counts(kernel, n_bins: int, block: int, arch: int) -> dict:
    """Registers, spills, shared memory and SASS opcode counts of one compile."""
    bins = torch.zeros(block, dtype=torch.int32)
    hist = torch.zeros(n_bins, dtype=torch.int32)
    src, options = source(kernel, (bins, hist),
                          {"BLOCK": block, "N_BINS": n_bins, "num_warps": NUM_WARPS})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return {**resource_usage(compiled.asm["ptx"], arch), "shared_bytes": compiled.metadata.shared,
            "opcodes": sass_opcodes(compiled.asm["cubin"])}


def candidate_row(name: str, elements: int, arch: int) -> dict:
    kernel, n_bins, (small, large) = CANDIDATES[name]
    low, high = (compiled_counts(kernel, n_bins, block, arch) for block in (small, large))
    # Each warp holds block / NUM_WARPS elements; a lane's instruction serves one of them.
    elements_a_lane = (large - small) / (NUM_WARPS * 32)
    per_element = {op: (high["opcodes"][op] - low["opcodes"][op]) / elements_a_lane
                   for op in ("POPC", "REDG", "ATOMS", "BAR")}
    sass = (sum(high["opcodes"].values()) - sum(low["opcodes"].values())) / elements_a_lane
    issue_us = elements * sass / (H200_SMS * LANES_A_CLOCK * H200_CLOCK_HZ) * 1e6
    popc_us = elements * per_element["POPC"] / (H200_SMS * POPC_A_CLOCK * H200_CLOCK_HZ) * 1e6
    return {"candidate": name, "n_bins": n_bins, "registers": high["registers"],
            "spill_bytes": high["spill_bytes"], "shared_bytes": high["shared_bytes"],
            "sass_per_element": sass, **{f"{op.lower()}_per_element": v
                                         for op, v in per_element.items()},
            "issue_bound_us": issue_us, "popc_bound_us": popc_us}


def distinct_fractions(tokens: int, experts: int, k: int, d: int, n_bins: int,
                       blocks: list[int]) -> dict[int, float]:
    """Block size -> distinct (expert, bin) pairs over the block's tokens x experts (the share of
    atomics left after summing equal pairs), on bench/qb_route.py's logits."""
    torch.manual_seed(0)
    router = Router(d, experts, k)
    router.init_weights(0.02)
    logits = torch.randn(tokens, d) @ router.weight.t()
    scores = torch.sigmoid(logits)
    alpha = (scores + router.expert_bias).topk(k + 1).values[:, k]
    lo, hi = qb_range(router.expert_bias)
    # qb_histogram's binning, kept per element (it only returns the counts); checked against it.
    bins = ((alpha[:, None] - scores - lo) * (n_bins / (hi - lo))).floor().clamp(0, n_bins - 1)
    pairs = bins.long() + torch.arange(experts) * n_bins
    counts = torch.bincount(pairs.view(-1), minlength=experts * n_bins).view(experts, n_bins)
    if not torch.equal(counts.int(), qb_histogram(scores, alpha, router.expert_bias, n_bins)):
        raise AssertionError("the bins here are not qb_histogram's")
    fractions = {}
    for block in blocks:
        groups = pairs[: tokens // block * block].view(-1, block * experts)
        fractions[block] = sum(len(group.unique()) for group in groups) / groups.numel()
    return fractions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384,896", help="T,E: the elements counted")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated, of: {', '.join(CANDIDATES)}")
    parser.add_argument("--aggregation", action="store_true",
                        help="also measure the atomics left after summing equal pairs (CPU)")
    parser.add_argument("--routing", default="16,7168,1000", help="k,d,n_bins for --aggregation")
    parser.add_argument("--blocks", default="8,64,1024", help="token blocks for --aggregation")
    parser.add_argument("--arch", type=positive, default=90, help="CUDA compute capability")
    parser.add_argument("--out", type=Path, default=Path("qb_histogram_static.json"))
    opts = parser.parse_args(argv)
    tokens, experts = (int(v) for v in opts.shape.split(","))
    names = [name for name in opts.candidates.split(",") if name]
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        parser.error(f"--candidates: unknown {unknown}")
    elements = tokens * experts
    print(f"{elements / 1e6:.1f}M elements (T {tokens} x E {experts}) counted, sm_{opts.arch}, "
          f"{NUM_WARPS} warps; lower bounds for the H200")
    print(f"{'candidate':<13} {'regs':>4} {'spill':>5} {'smem':>6} {'SASS/el':>7} {'POPC/el':>7} "
          f"{'RED/el':>6} {'issue us':>8} {'POPC us':>7}")
    rows = []
    for name in names:
        row = candidate_row(name, elements, opts.arch)
        rows.append(row)
        print(f"{name:<13} {row['registers']:4d} {row['spill_bytes']:5d} "
              f"{row['shared_bytes']:6d} {row['sass_per_element']:7.1f} "
              f"{row['popc_per_element']:7.1f} {row['redg_per_element']:6.1f} "
              f"{row['issue_bound_us']:8.1f} {row['popc_bound_us']:7.1f}", flush=True)
    if opts.aggregation:
        k, d, n_bins = (int(v) for v in opts.routing.split(","))
        blocks = [int(v) for v in opts.blocks.split(",") if v]
        print(f"atomics left after summing equal (expert, bin) pairs over a block of tokens "
              f"(k {k}, d {d}, {n_bins} bins)")
        for block, fraction in distinct_fractions(tokens, experts, k, d, n_bins, blocks).items():
            rows.append({"aggregation_block": block, "atomics_left": fraction})
            print(f"block {block:6d}: {fraction:.3f}")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
