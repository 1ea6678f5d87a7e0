"""The MoE layer's dispatch (token rows into the expert-grouped buffer) and combine (the
weighted sum of each token's expert rows), laid out like fla's op folders:

    naive.py                  the PyTorch reference, with the maths
    moe_dispatch_triton.py    the Triton ops (titan_moe::moe_dispatch / moe_combine + backwards)

`moe_dispatch` and `moe_combine` are the entry points: on CUDA the Triton ops, elsewhere the
reference. The branch is on the device, in Python, before any op is called: Inductor cannot
compile user Triton kernels for CPU tensors.
"""

from torch import Tensor

from titan_moe.ops.moe_dispatch.moe_dispatch_triton import (
    combine_shape,
    moe_combine_bwd_triton,
    moe_combine_triton,
    moe_dispatch_bwd_triton,
    moe_dispatch_triton,
    validate_moe_dispatch_inputs,
)
from titan_moe.ops.moe_dispatch.naive import moe_combine_naive, moe_dispatch_naive

__all__ = ["moe_combine", "moe_combine_bwd_triton", "moe_combine_naive", "moe_combine_triton",
           "moe_dispatch", "moe_dispatch_bwd_triton", "moe_dispatch_naive", "moe_dispatch_triton"]


def moe_dispatch(z: Tensor, dest: Tensor, src: Tensor, top_k: int) -> Tensor:
    """z [N, d], dest [N·k] int64 (pair p = t·k + j goes to row dest[p], rows distinct), src [R]
    int64 (dest's inverse: src[dest[p]] = p, -1 on rows no pair takes) -> grouped [R, d] in z's
    dtype, zero on the rows no pair takes. See `naive` for the maths."""
    validate_moe_dispatch_inputs(z, dest, src, z.shape[0], top_k)
    if z.is_cuda:
        return moe_dispatch_triton(z, dest, src, top_k)
    return moe_dispatch_naive(z, dest, src.shape[0], top_k)


def moe_combine(expert_out: Tensor, dest: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    """expert_out [R, d], dest [N·k], src [R] (as in `moe_dispatch`), weights [N, k] -> u [N, d]
    = Σ_j weights[t, j] expert_out[dest[t·k + j]], in the promoted dtype of expert_out and
    weights. Rows no pair takes are never read; their gradient is zero."""
    validate_moe_dispatch_inputs(expert_out, dest, src, *combine_shape(weights))
    if expert_out.is_cuda:
        return moe_combine_triton(expert_out, dest, src, weights)
    return moe_combine_naive(expert_out, dest, weights)
