"""The MoE layer's dispatch layout (which buffer row each (token, slot) pair takes), dispatch
(token rows into the expert-grouped buffer) and combine (the weighted sum of each token's expert
rows), laid out like fla's op folders:

    naive.py                  the PyTorch reference, with the maths
    layout_triton.py          the layout, a counting sort (titan_moe::dispatch_layout)
    moe_dispatch_triton.py    the Triton ops (titan_moe::moe_dispatch / moe_combine + backwards)

`dispatch_layout`, `moe_dispatch` and `moe_combine` are the entry points: on CUDA the Triton
ops (eagerly their bodies, without the dispatcher: `titan_moe.ops.direct_call`), elsewhere the
reference. The branch is on the device, in Python, before any op is called:
Inductor cannot compile user Triton kernels for CPU tensors.
"""

import torch
from torch import Tensor

from titan_moe.ops.moe_dispatch.layout_triton import dispatch_layout_call, dispatch_layout_triton
from titan_moe.ops.moe_dispatch.moe_dispatch_triton import (
    combine_shape,
    moe_combine_bwd_triton,
    moe_combine_call,
    moe_combine_triton,
    moe_dispatch_bwd_triton,
    moe_dispatch_call,
    moe_dispatch_triton,
    validate_moe_dispatch_inputs,
)
from titan_moe.ops.moe_dispatch.naive import (
    dispatch_layout_naive,
    layout_rows,
    moe_combine_naive,
    moe_dispatch_naive,
)

__all__ = ["dispatch_layout", "dispatch_layout_call", "dispatch_layout_naive",
           "dispatch_layout_triton", "layout_rows", "moe_combine", "moe_combine_bwd_triton",
           "moe_combine_call", "moe_combine_naive", "moe_combine_triton", "moe_dispatch",
           "moe_dispatch_bwd_triton", "moe_dispatch_call", "moe_dispatch_naive",
           "moe_dispatch_triton"]


def dispatch_layout(
    pair_expert: Tensor, n_experts: int, align: int
) -> tuple[Tensor, Tensor, Tensor]:
    """pair_expert [P] int64 expert of each pair -> (dest [P] int64 row of each pair, src
    [n_rows] int64 the pair of each row, -1 where none, offs [E] int32 padded group ends), rows
    grouped by expert in pair order, each group padded to a multiple of align; n_rows is the
    static `layout_rows(P, E, align)`. See `naive` for the maths."""
    if not pair_expert.is_cuda:
        return dispatch_layout_naive(pair_expert, n_experts, align)
    n_rows = layout_rows(pair_expert.numel(), n_experts, align)
    return dispatch_layout_call(pair_expert, n_experts, align, n_rows)


def moe_dispatch(z: Tensor, dest: Tensor, src: Tensor, top_k: int) -> Tensor:
    """z [N, d], dest [N·k] int64 (pair p = t·k + j goes to row dest[p], rows distinct), src [R]
    int64 (dest's inverse: src[dest[p]] = p, -1 on rows no pair takes) -> grouped [R, d] in z's
    dtype, zero on the rows no pair takes. See `naive` for the maths."""
    validate_moe_dispatch_inputs(z, dest, src, z.shape[0], top_k)
    if z.is_cuda:
        return moe_dispatch_call(z, dest, src, top_k)
    return moe_dispatch_naive(z, dest, src.shape[0], top_k)


def moe_combine(
    expert_out: Tensor, dest: Tensor, src: Tensor, weights: Tensor,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """expert_out [R, d], dest [N·k], src [R] (as in `moe_dispatch`), weights [N, k] -> u [N, d]
    = Σ_j weights[t, j] expert_out[dest[t·k + j]], summed in the promoted dtype of expert_out
    and weights, returned in out_dtype (default: that promoted dtype). Rows no pair takes are
    never read; their gradient is zero. The Triton op rounds to out_dtype as it writes, and its
    backward reads the gradient in out_dtype: no wider copy of u or of its gradient is made."""
    validate_moe_dispatch_inputs(expert_out, dest, src, *combine_shape(weights))
    if expert_out.is_cuda:
        return moe_combine_call(expert_out, dest, src, weights, out_dtype)
    return moe_combine_naive(expert_out, dest, weights, out_dtype)
