"""Matrix products of half-precision operands, accumulated and returned in fp32.

On CUDA, cuBLAS takes bf16/fp16 operands with an fp32 output (`out_dtype`): tensor cores, no
widened copy. Elsewhere (torch 2.13 has no CPU `mm.dtype` kernel; the meta device of the memory
plan) the operands are widened first, which computes the same sums up to their order: a product
of two bf16 (or fp16) numbers is exact in fp32.
"""

import torch
from torch import Tensor

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _widened(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(wide), b.to(wide)


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N] -> [M, N] fp32 (float64 if an operand is)."""
    if a.is_cuda and a.dtype in HALF_DTYPES and b.dtype == a.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(*_widened(a, b))


def bmm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N] fp32 (float64 if an operand is)."""
    if a.is_cuda and a.dtype in HALF_DTYPES and b.dtype == a.dtype:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(*_widened(a, b))
