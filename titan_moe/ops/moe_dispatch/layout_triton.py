"""The dispatch layout (`naive.dispatch_layout_naive` has its definition) as a stable counting
sort in three Triton kernels, with no sort of the whole list of pairs:

    block_ranks_kernel    one program per BLOCK pairs: the block's count of each expert (its
                          histogram), and each pair's rank among the block's pairs of its
                          expert (the block sorted by (expert, pair), then a scan that counts
                          along each expert's run)
    group_starts_kernel   one program: each expert's pairs in the blocks before each block (the
                          counts summed down the blocks, in place), each group's padded start and
                          end (offs), and src = -1 on the rows no pair takes (each group's
                          padding and the buffer's tail)
    pair_rows_kernel      one program per BLOCK pairs: pair p of expert e in block b takes row
                          start[e] + (e's pairs in the blocks before b) + rank[p]; dest[p] is
                          that row and src of that row is p

Pairs keep their order inside a group, as in the reference's stable sort, so the layout is the
reference's bit for bit and the same on every run.

What it replaces: torch.sort of the pairs' experts (CUB's radix sort: a fill of the indices, a
histogram, a scan and a pass a byte of key) and two kernels after it. Compiled, the sort is
an eager ATen call in Inductor's wrapper: the most host time of any op in the d-512 MoE layer's
compiled forward (0.16 of 1.98 profiled ms; H100, 2026-12-07), whose compiled row is host-bound.
On the H100 (bench/moe_dispatch.py) the layout takes 0.104 ms at d 512's 16,384 tokens x top-4 of
128 and 0.200 ms at 16,384 x top-16 of 896, against 0.319 and 0.395 for the compiled reference.

`titan_moe::dispatch_layout` is a `torch.library.triton_op` (compile sees the kernels); its
outputs are integers, with no gradient. Eager calls take `dispatch_layout_call`
(`titan_moe.ops.direct_call`). CUDA only: callers branch on the device
(`titan_moe.ops.moe_dispatch`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.direct_call import direct_call

BLOCK, WARPS = 1024, 4
# group_starts_kernel sums the counts down the blocks a tile of about this many at a time.
TILE = 8192


@triton.jit
def _count_along_runs(count_a, expert_a, count_b, expert_b):
    """Inclusive scan that restarts where the expert changes: associative when each expert's
    elements are contiguous, as they are in a block sorted by expert."""
    return tl.where(expert_a == expert_b, count_a + count_b, count_b), expert_b


@triton.jit
def block_ranks_kernel(expert_ptr, counts_ptr, rank_ptr, P, E, BLOCK: tl.constexpr,
                       BINS: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    pair = block * BLOCK + lane
    # Lanes past the last pair take expert E: bin E is counted but not stored (BINS > E), and
    # they sort after every pair.
    expert = tl.load(expert_ptr + pair, mask=pair < P, other=E).to(tl.int32)
    bins = tl.arange(0, BINS)
    tl.store(counts_ptr + block * E + bins, tl.histogram(expert, BINS), mask=bins < E)
    # (expert, lane) as one key: unique, so the sort orders each expert's pairs by lane.
    key = tl.sort(expert * BLOCK + lane)
    sorted_expert = key // BLOCK
    sorted_pair = block * BLOCK + key % BLOCK
    run, _ = tl.associative_scan((tl.full([BLOCK], 1, tl.int32), sorted_expert), 0,
                                 _count_along_runs)
    tl.store(rank_ptr + sorted_pair, run - 1, mask=sorted_pair < P)


@triton.jit
def group_starts_kernel(counts_ptr, start_ptr, offs_ptr, src_ptr, n_blocks, P, E, R,
                        ALIGN: tl.constexpr, TILE_B: tl.constexpr,
                        BLOCK_E: tl.constexpr):  # fmt: skip
    experts = tl.arange(0, BLOCK_E)
    is_expert = experts < E
    total = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's pairs in the blocks so far
    # While loops, not ranges over runtime bounds: the interpreter (tests on CPU) cannot take
    # those with NumPy 2.
    first = 0
    while first < n_blocks:
        blocks = first + tl.arange(0, TILE_B)
        at = blocks[:, None] * E + experts[None, :]
        ok = (blocks[:, None] < n_blocks) & is_expert[None, :]
        counts = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(counts_ptr + at, tl.cumsum(counts, 0) - counts + total[None, :], mask=ok)
        total += tl.sum(counts, 0)
        first += TILE_B
    padded = (total + ALIGN - 1) // ALIGN * ALIGN
    end = tl.cumsum(padded, 0)
    start = end - padded
    tl.store(start_ptr + experts, start, mask=is_expert)
    tl.store(offs_ptr + experts, end, mask=is_expert)
    none = tl.full([BLOCK_E], -1, dtype=tl.int64)
    for j in tl.static_range(ALIGN - 1):  # a group's padding is under ALIGN rows
        row = start + total + j
        tl.store(src_ptr + row, none, mask=is_expert & (row < end))
    # The tail, past the last group: its rows lie in [P, R), fewer than ALIGN * BLOCK_E.
    used = tl.sum(padded, 0)
    first = P
    while first < R:
        rows = first + experts
        tl.store(src_ptr + rows, none, mask=(rows >= used) & (rows < R))
        first += BLOCK_E


@triton.jit
def pair_rows_kernel(expert_ptr, before_ptr, rank_ptr, start_ptr, dest_ptr, src_ptr, P, E,
                     BLOCK: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    pair = block * BLOCK + tl.arange(0, BLOCK)
    is_pair = pair < P
    expert = tl.load(expert_ptr + pair, mask=is_pair, other=0).to(tl.int32)
    row = (tl.load(start_ptr + expert, mask=is_pair, other=0)
           + tl.load(before_ptr + block * E + expert, mask=is_pair, other=0)
           + tl.load(rank_ptr + pair, mask=is_pair, other=0))
    tl.store(dest_ptr + pair, row.to(tl.int64), mask=is_pair)
    tl.store(src_ptr + row, pair.to(tl.int64), mask=is_pair)


def _dispatch_layout(
    pair_expert: Tensor, n_experts: int, align: int, n_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """pair_expert [P] int64 each pair's expert -> (dest [P] int64, src [n_rows] int64, offs [E]
    int32), as `dispatch_layout_naive` returns them. Rows are int32 inside the kernels."""
    pair_expert = pair_expert.contiguous()  # the kernels read it as a flat array
    n_pairs = pair_expert.numel()
    device = pair_expert.device
    n_blocks = triton.cdiv(n_pairs, BLOCK)
    counts = torch.empty(n_blocks, n_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n_pairs, dtype=torch.int32, device=device)
    start = torch.empty(n_experts, dtype=torch.int32, device=device)
    offs = torch.empty(n_experts, dtype=torch.int32, device=device)
    dest = torch.empty(n_pairs, dtype=torch.int64, device=device)
    src = torch.empty(n_rows, dtype=torch.int64, device=device)
    block_e = triton.next_power_of_2(n_experts)
    if n_pairs:
        wrap_triton(block_ranks_kernel)[(n_blocks,)](
            pair_expert, counts, rank, n_pairs, n_experts, BLOCK=BLOCK,
            BINS=triton.next_power_of_2(n_experts + 1), num_warps=WARPS,
        )  # fmt: skip
    wrap_triton(group_starts_kernel)[(1,)](
        counts, start, offs, src, n_blocks, n_pairs, n_experts, n_rows, ALIGN=align,
        TILE_B=max(1, TILE // block_e), BLOCK_E=block_e, num_warps=WARPS,
    )  # fmt: skip
    if n_pairs:
        wrap_triton(pair_rows_kernel)[(n_blocks,)](
            pair_expert, counts, rank, start, dest, src, n_pairs, n_experts, BLOCK=BLOCK,
            num_warps=WARPS,
        )  # fmt: skip
    return dest, src, offs


dispatch_layout_triton = triton_op("titan_moe::dispatch_layout", mutates_args={})(
    _dispatch_layout)
dispatch_layout_call = direct_call(dispatch_layout_triton, _dispatch_layout)
