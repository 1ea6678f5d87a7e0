"""SiTU-GLU, h = SiTU_β1(a) ⊙ β2·tanh(b/β2) (spec §5), laid out like fla's op folders:

    naive.py             the PyTorch reference (and `situ`, the gate alone)
    situ_glu_triton.py   the Triton ops (titan_moe::situ_glu / situ_glu_bwd, and the packed
                         form situ_glu_packed / situ_glu_packed_bwd), for eager CUDA

`situ_glu(a, b)` and `situ_glu_packed(ab)` (ab = [a | b] along the last dim) are the entry
points: eager CUDA tensors (fp32/bf16/fp16) take the Triton kernels (through `*_call`, without
the dispatcher: `titan_moe.ops.direct_call`); CPU tensors and graphs being compiled take the
reference, whose ops Inductor fuses into one kernel each way
(compile_passes/situ_glu_fusion.py matches them). The branch is in Python, before any op is
called.
"""

import torch
from torch import Tensor

from titan_moe.ops.situ_glu.naive import situ, situ_glu_naive, situ_glu_packed_naive
from titan_moe.ops.situ_glu.situ_glu_triton import (
    situ_glu_bwd_triton,
    situ_glu_call,
    situ_glu_packed_bwd_triton,
    situ_glu_packed_call,
    situ_glu_packed_triton,
    situ_glu_triton,
    validate_packed_input,
)

__all__ = ["situ", "situ_glu", "situ_glu_bwd_triton", "situ_glu_call", "situ_glu_naive",
           "situ_glu_packed", "situ_glu_packed_bwd_triton", "situ_glu_packed_call",
           "situ_glu_packed_naive", "situ_glu_packed_triton", "situ_glu_triton"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def situ_glu(a: Tensor, b: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """h = SiTU_β1(a) ⊙ β2·tanh(b/β2), computed in (at least) fp32, returned in a's dtype."""
    if a.is_cuda and a.dtype in _TRITON_DTYPES and not torch.compiler.is_compiling():
        return situ_glu_call(a, b, beta1, beta2)
    return situ_glu_naive(a, b, beta1, beta2)


def situ_glu_packed(ab: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """ab [..., 2H] = [a | b] -> h [..., H] = situ_glu(a, b): the halves read in place, and on
    eager CUDA the gradient written as one [..., 2H] tensor."""
    validate_packed_input(ab)
    if ab.is_cuda and ab.dtype in _TRITON_DTYPES and not torch.compiler.is_compiling():
        return situ_glu_packed_call(ab, beta1, beta2)
    return situ_glu_packed_naive(ab, beta1, beta2)
