"""Rows of a tensor picked by an index without repeats, whose backward needs no atomics.

    out[i] = x[index[i]]            index [P] int64, all entries distinct
    dx[index[i]] = dout[i], dx = 0 on the rows no entry picks

`x.index_select(0, index)` computes the same forward, but its backward is `index_add`, which
must allow repeated rows: on CUDA that is an atomic add per element (bf16 atomics are
compare-and-swap loops; 8.6 ms of a 325 ms proxy step on the H200, bench/RESULTS.md 2026-12-04).
With distinct rows a plain `index_copy` scatter is exact, deterministic and atomic-free. The
MoE combine's reference (`ops/moe_dispatch/naive.py`) reads each (token, slot) pair's row of
the expert buffer this way.
"""

import torch
from torch import Tensor


class _GatherDistinctRows(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, index: Tensor) -> Tensor:
        return x.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, index = inputs
        ctx.save_for_backward(index)
        ctx.n_rows = x.shape[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        dx = grad.new_zeros(ctx.n_rows, *grad.shape[1:]).index_copy(0, index, grad)
        return dx, None


def gather_distinct_rows(x: Tensor, index: Tensor) -> Tensor:
    """x[index] along dim 0 for an index whose entries are distinct (not checked: a check would
    read the index on the host); the gradient is scattered back without accumulation."""
    return _GatherDistinctRows.apply(x, index)
