"""Block Attention Residuals: one learned softmax mix over a site's residual sources (spec §2).

`attn_res_mix` is the entry point: on CUDA with 1 ≤ n ≤ 9 fp32/bf16/fp16 sources the Triton op
(`attn_res_triton.py`: each source read once forward, twice backward), elsewhere the PyTorch
reference (`naive.py`, also float64 and any n). The branch is on the device, in Python, before
any op is called: Inductor cannot compile user Triton kernels for CPU tensors.
"""

import torch
from torch import Tensor

from titan_moe.ops.attn_res.attn_res_triton import TRITON_DTYPES, attn_res_mix_triton
from titan_moe.ops.attn_res.naive import (
    MAX_SOURCES,
    attn_res_mix_naive,
    validate_attn_res_inputs,
)

__all__ = ["attn_res_mix", "attn_res_mix_naive", "attn_res_mix_triton", "uses_triton"]


def uses_triton(sources: list[Tensor]) -> bool:
    """Whether `attn_res_mix` takes the Triton op for these sources."""
    return (
        len(sources) <= MAX_SOURCES
        and sources[0].is_cuda
        and all(v.dtype in TRITON_DTYPES for v in sources)
    )


def attn_res_mix(
    sources: list[Tensor], query: Tensor, gain: Tensor, eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """sources: n tensors [..., d] of one shape; query, gain: [d] -> [..., d] computed in fp32
    (float64 for float64 sources) and returned in out_dtype if given. The Triton op writes
    out_dtype itself, so no wider copy of the output or of its gradient is made. See
    `naive.attn_res_mix_naive` for the definition."""
    validate_attn_res_inputs(sources, query, gain, None)
    if uses_triton(sources) and out_dtype in (None, *TRITON_DTYPES):
        return attn_res_mix_triton(sources, query, gain, eps, out_dtype or torch.float32)
    out = attn_res_mix_naive(sources, query, gain, eps)
    return out if out_dtype is None else out.to(out_dtype)
