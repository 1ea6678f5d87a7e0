"""The dispatch layout (`naive.dispatch_layout_naive` has its definition) after the sort, as two
Triton kernels:

    group_bounds_kernel   one program: each expert's first sorted position and pair count (a
                          binary search of the sorted keys for e and e + 1, all experts at once),
                          its padded start (a cumsum of the counts rounded up to `align`) and
                          the padded group ends (offs)
    pair_rows_kernel      one program per BLOCK positions, each position both a sorted pair
                          and a buffer row: pair j of group e takes row j + padded_start[e] -
                          start[e] (dest, scattered through the sort's permutation: each entry
                          written once); row r finds its group by a binary search of offs and
                          names its pair, or -1 on padding and the tail (src, a gather: no fill
                          first, no atomics)

What it replaces: the reference after the sort is searchsorted, diff, cumsum, two scatters and
a fill, nine kernels as Inductor compiled them (torch 2.11, H100), so on a step that is not
CUDA-graphed the layer's host time ran ahead of those tiny kernels: the MoE layer compiled spent
about 2.4 ms of host time where the GPU needed 1.5 ms at d 512 (bench/moe.py, 2026-12-06). Two
launches carry the same integers. `titan_moe::dispatch_layout_rows` is a
`torch.library.triton_op` (compile sees the kernels); its outputs are integers, with no
gradient. Eager calls take `dispatch_layout_rows_call` (`titan_moe.ops.direct_call`). CUDA
only: callers branch on the device (`titan_moe.ops.moe_dispatch`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.direct_call import direct_call

BLOCK, WARPS = 1024, 4
# Binary-search steps over the sorted pairs: positions are int32, so 31 cover any P. A constant,
# not P's bit length: under dynamic shapes P is symbolic.
PAIR_STEPS = 31


@triton.jit
def _lower_bound(keys_ptr, n, value, STEPS: tl.constexpr):
    """The first index i < n with keys[i] >= value (n where none), keys ascending; each lane of
    value searched at once. STEPS >= bit length of n.

    A loop, not `tl.static_range`: unrolled, each step's lo and hi both read the last step's, and
    torch 2.13's Inductor, which walks every path back from each load to find what a kernel
    reads, met 2^31 paths in group_bounds_kernel and did not finish (CPU host, sm_90 TTIR,
    2026-12-07: tests/ops/test_kernel_writes.py), so compiling the layer would hang there."""
    lo = tl.zeros_like(value)
    hi = lo + n
    for _ in range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        key = tl.load(keys_ptr + mid, mask=active, other=0).to(value.dtype)
        below = key < value
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & (key >= value), mid, hi)
    return lo


@triton.jit
def group_bounds_kernel(keys_ptr, bounds_ptr, offs_ptr, P, E, ALIGN: tl.constexpr,
                        BLOCK_E: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
    experts = tl.arange(0, BLOCK_E)
    ok = experts < E
    start = _lower_bound(keys_ptr, P, experts, STEPS)
    count = _lower_bound(keys_ptr, P, experts + 1, STEPS) - start  # 0 past E
    padded = (count + ALIGN - 1) // ALIGN * ALIGN
    padded_end = tl.cumsum(padded, 0)
    tl.store(bounds_ptr + experts, start.to(tl.int64), mask=ok)
    tl.store(bounds_ptr + E + experts, count.to(tl.int64), mask=ok)
    tl.store(bounds_ptr + 2 * E + experts, (padded_end - padded).to(tl.int64), mask=ok)
    tl.store(offs_ptr + experts, padded_end.to(tl.int32), mask=ok)


@triton.jit
def pair_rows_kernel(keys_ptr, order_ptr, bounds_ptr, offs_ptr, dest_ptr, src_ptr, P, R, E,
                     BLOCK: tl.constexpr, E_STEPS: tl.constexpr):  # fmt: skip
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # pos as a sorted pair: its row, stored at the pair's own index.
    is_pair = pos < P
    expert = tl.load(keys_ptr + pos, mask=is_pair, other=0).to(tl.int32)
    start = tl.load(bounds_ptr + expert, mask=is_pair, other=0)
    padded_start = tl.load(bounds_ptr + 2 * E + expert, mask=is_pair, other=0)
    pair = tl.load(order_ptr + pos, mask=is_pair, other=0)
    tl.store(dest_ptr + pair, pos + padded_start - start, mask=is_pair)
    # pos as a buffer row: its group is the first whose padded end lies past it.
    is_row = pos < R
    group = _lower_bound(offs_ptr, E, pos + 1, E_STEPS)
    in_group = is_row & (group < E)
    inside = pos - tl.load(bounds_ptr + 2 * E + group, mask=in_group, other=0)
    taken = in_group & (inside < tl.load(bounds_ptr + E + group, mask=in_group, other=0))
    sorted_at = tl.load(bounds_ptr + group, mask=taken, other=0) + inside
    row_pair = tl.load(order_ptr + sorted_at, mask=taken, other=-1)
    tl.store(src_ptr + pos, tl.where(taken, row_pair, -1), mask=is_row)


def _dispatch_layout_rows(
    sorted_key: Tensor, order: Tensor, n_experts: int, align: int, n_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """sorted_key [P] uint8/int16/int32 the pairs' experts sorted (stable), order [P] int64 the
    sort's permutation -> (dest [P] int64, src [n_rows] int64, offs [E] int32), as
    `dispatch_layout_naive` returns them."""
    n_pairs = sorted_key.numel()
    device = sorted_key.device
    bounds = torch.empty(3, n_experts, dtype=torch.int64, device=device)
    offs = torch.empty(n_experts, dtype=torch.int32, device=device)
    dest = torch.empty(n_pairs, dtype=torch.int64, device=device)
    src = torch.empty(n_rows, dtype=torch.int64, device=device)
    block_e = triton.next_power_of_2(n_experts)
    wrap_triton(group_bounds_kernel)[(1,)](
        sorted_key, bounds, offs, n_pairs, n_experts, ALIGN=align, BLOCK_E=block_e,
        STEPS=PAIR_STEPS, num_warps=max(1, min(8, block_e // 128)),
    )  # fmt: skip
    positions = max(n_pairs, n_rows)
    if positions:
        wrap_triton(pair_rows_kernel)[(triton.cdiv(positions, BLOCK),)](
            sorted_key, order, bounds, offs, dest, src, n_pairs, n_rows, n_experts,
            BLOCK=BLOCK, E_STEPS=max(1, n_experts.bit_length()), num_warps=WARPS,
        )  # fmt: skip
    return dest, src, offs


dispatch_layout_rows_triton = triton_op("titan_moe::dispatch_layout_rows", mutates_args={})(
    _dispatch_layout_rows)
dispatch_layout_rows_call = direct_call(dispatch_layout_rows_triton, _dispatch_layout_rows)
