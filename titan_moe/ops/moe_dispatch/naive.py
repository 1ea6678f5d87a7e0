"""The MoE layer's dispatch and combine in plain PyTorch: the reference of the Triton ops.

The router gives each token t its k experts; pair p = t·k + j is token t's j-th choice, and
dest[p] is the row of the expert-grouped buffer that pair p takes (`dispatch_layout_naive`:
rows grouped by expert, each group padded with rows no pair takes).

    layout     pairs sorted by expert (stable); group e starts at padded_start[e] = Σ_{e'<e}
               round_up(count[e'], align), and its i-th pair in pair order takes row
               padded_start[e] + i; src[r] is the pair on row r, -1 where none

    dispatch   grouped[dest[p]] = z[p // k],   grouped[r] = 0 on every row no pair takes
    combine    u[t] = Σ_j w[t, j] · expert_out[dest[t·k + j]]   (in w's precision)

Their gradients:

    dispatch   dz[t] = Σ_j dgrouped[dest[t·k + j]]
    combine    dexpert_out[dest[p]] = w[p] · du[p // k],  0 on every row no pair takes
               dw[p] = <expert_out[dest[p]], du[p // k]>

Every pair has its own row, so both scatters are plain copies (no accumulation), and the rows no
pair takes (group padding, the buffer's tail) are zero both ways: the grouped GEMMs' weight
gradients read the padding rows, and whatever the experts left in them is never read.
"""

import torch
from torch import Tensor

from titan_moe.ops.gather_rows import gather_distinct_rows


def moe_dispatch_naive(z: Tensor, dest: Tensor, n_rows: int, top_k: int) -> Tensor:
    """z [N, d], dest [N·k] int64 distinct rows -> grouped [n_rows, d] in z's dtype."""
    pairs = z.unsqueeze(1).expand(z.shape[0], top_k, z.shape[1]).reshape(-1, z.shape[1])
    return z.new_zeros(n_rows, z.shape[1]).index_copy(0, dest, pairs)


def moe_combine_naive(
    expert_out: Tensor, dest: Tensor, weights: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """expert_out [R, d], dest [N·k] int64 distinct rows, weights [N, k] -> u [N, d], summed in
    the promoted dtype of expert_out and weights (fp32 for bf16 rows and fp32 weights) and
    returned in out_dtype (default: that promoted dtype)."""
    n_tokens, top_k = weights.shape
    pair_out = gather_distinct_rows(expert_out, dest).view(n_tokens, top_k, -1)
    dtype = torch.promote_types(expert_out.dtype, weights.dtype)
    u = (pair_out.to(dtype) * weights.unsqueeze(-1).to(dtype)).sum(1)
    return u if out_dtype is None else u.to(out_dtype)


def round_up(n, multiple: int):
    """n (an int or an integer tensor) rounded up to a multiple of `multiple`."""
    return (n + multiple - 1) // multiple * multiple


def layout_rows(n_pairs: int, n_experts: int, align: int) -> int:
    """The grouped buffer's static size: every group may need up to align - 1 padding rows."""
    return round_up(n_pairs + n_experts * (align - 1), align)


def dispatch_layout_naive(
    pair_expert: Tensor, n_experts: int, align: int
) -> tuple[Tensor, Tensor, Tensor]:
    """pair_expert [P] int64 expert of each pair -> (dest [P] int64 row of each pair, src
    [n_rows] int64 the pair of each row (-1 where none: padding and the tail), offs [E] int32
    padded group ends). n_rows is `layout_rows`. Pairs keep their order inside a group."""
    n_pairs = pair_expert.numel()
    n_rows = layout_rows(n_pairs, n_experts, align)
    sorted_expert, order = torch.sort(pair_expert, stable=True)
    experts = torch.arange(n_experts, device=pair_expert.device)
    ends = torch.searchsorted(sorted_expert, experts + 1)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = round_up(counts, align)
    padded_ends = torch.cumsum(padded_counts, 0)
    # Every pair of group e moves from its sorted position by the group's change of start.
    shift = (padded_ends - padded_counts) - (ends - counts)
    dest_sorted = torch.arange(n_pairs, device=pair_expert.device) + shift[sorted_expert]
    dest = torch.empty_like(order).scatter_(0, order, dest_sorted)
    src = torch.full((n_rows,), -1, dtype=order.dtype, device=order.device)
    return dest, src.scatter_(0, dest_sorted, order), padded_ends.to(torch.int32)
