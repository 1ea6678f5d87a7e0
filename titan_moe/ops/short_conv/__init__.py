"""Short convolution: causal depthwise conv over T (restarting at document starts), SiLU and an
optional per-head L2 norm, laid out like fla's op folders:

    naive.py              the PyTorch reference (and `causal_depthwise_conv`, the conv alone)
    short_conv_triton.py  the Triton op (titan_moe::short_conv / short_conv_bwd)

`short_conv` is the entry point: on CUDA (fp32/bf16/fp16 x) the Triton op, elsewhere the
reference. The branch is on the device, in Python, before any op is called: Inductor cannot
compile user Triton kernels for CPU tensors.
"""

import torch
from torch import Tensor

from titan_moe.ops.short_conv.naive import NORM_EPS, causal_depthwise_conv, short_conv_naive
from titan_moe.ops.short_conv.short_conv_triton import (
    short_conv_bwd_triton,
    short_conv_triton,
    validate_short_conv_inputs,
)

__all__ = ["NORM_EPS", "causal_depthwise_conv", "short_conv", "short_conv_bwd_triton",
           "short_conv_naive", "short_conv_triton"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def short_conv(
    x: Tensor, weight: Tensor, doc_ids: Tensor | None = None, head_dim: int | None = None
) -> Tensor:
    """x [B, T, C], weight [C, K], doc_ids [B, T] or None -> y [B, T, C] in x's dtype.

    y = SiLU(causal depthwise conv of x), then, with head_dim, each head's head_dim channels
    L2-normalised (eps NORM_EPS). See `naive.short_conv_naive` for the definition.
    """
    validate_short_conv_inputs(x, weight, doc_ids, head_dim)
    if x.is_cuda and x.dtype in _TRITON_DTYPES:
        docs = None if doc_ids is None else doc_ids.to(torch.int32).contiguous()
        return short_conv_triton(x.contiguous(), weight.contiguous(), docs, head_dim or 0)
    return short_conv_naive(x, weight, doc_ids, head_dim)
