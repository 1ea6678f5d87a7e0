"""Sigmoid top-k routing with the Quantile Balancing histogram (spec §5, §6).

`qb_route` is the entry point: on CUDA (fp32/bf16/fp16 logits) the one-pass Triton op
(`qb_route_triton.py`; eagerly its body, without the dispatcher: `titan_moe.ops.direct_call`),
elsewhere the PyTorch reference (`naive.py`). The branch is on the
device, in Python, before any op is called: Inductor cannot compile user Triton kernels for CPU
tensors.
"""

import torch
from torch import Tensor

from titan_moe.ops.router.naive import qb_route_naive, routed_load, topk_lowest_index_on_ties
from titan_moe.ops.router.qb_route_triton import (
    qb_route_call,
    qb_route_triton,
    validate_route_inputs,
)
from titan_moe.ops.router.route_weights_grad_triton import (
    route_weights_grad_call,
    route_weights_grad_triton,
)

__all__ = ["qb_route", "qb_route_call", "qb_route_naive", "qb_route_triton", "routed_load",
           "route_weights_grad_call", "route_weights_grad_triton", "topk_lowest_index_on_ties"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qb_route(
    logits: Tensor,
    bias: Tensor,
    top_k: int,
    route_scale: float = 1.0,
    n_bins: int = 1000,
    valid: Tensor | None = None,
    with_histogram: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits [T, E] -> (ids [T, k] int64, weights [T, k], hist [E, n_bins], load [E]).

    See `naive.qb_route_naive` for the definition; hist and load have 0 rows when
    with_histogram is False.
    """
    validate_route_inputs(logits, bias, top_k, valid)
    if logits.is_cuda and logits.dtype in _TRITON_DTYPES:
        return qb_route_call(logits, bias, valid, top_k, route_scale, n_bins, with_histogram)
    return qb_route_naive(logits, bias, top_k, route_scale, n_bins, valid, with_histogram)
