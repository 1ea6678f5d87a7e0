"""x @ Wᵀ for bf16 activations and an fp32 weight, fp32-accurate on bf16 tensor cores.

    W = W_hi + W_lo + r,   W_hi = bf16(W),  W_lo = bf16(W - W_hi),  |r| <= 2^-16 |W|
    y = x W_hiᵀ + x W_loᵀ                    two bf16 GEMMs, accumulated and returned in fp32

x is bf16, so each product x·W_hi and x·W_lo is exact in fp32 (8 + 8 significant bits) and y
is an fp32 GEMM of x against W rounded to 16 significant bits: the same order of error as the
fp32 GEMM's own d-term accumulation. A single bf16 GEMM (W rounded to 8 bits) is 2^8 times
further off. The two GEMMs run as one, against [W_hi; W_lo] ([2E, d], so a narrow weight still
fills a tile), and the halves of its [N, 2E] output are added.

The backward keeps the same accuracy, from the same splits of the fp32 output gradient g:
    dx = g W  ≈ g_hi W_hi + g_lo W_hi + g_hi W_lo     one GEMM over the concatenated K = 3E,
                                                      bf16 out (x's dtype)
    dW = gᵀ x = g_hiᵀ x + g_loᵀ x                     one GEMM against [g_hi | g_lo], halves added
(the dropped g_lo W_lo term is at most 2^-16 |g| |W|).

The router's GEMM (model/router.py) is the user: an fp32 GEMM runs on CUDA cores, 4.2 ms at
T 16384, d 7168, E 896 on the H200 against 0.48 ms for one bf16 GEMM with an fp32 output, which
moved 1.7% of the proxy's tokens to another expert set (bench/router_precision.py).
"""

import torch
from torch import Tensor

from titan_moe.ops.fp32_matmul import mm_fp32


def rounded_to_bf16(t: Tensor) -> Tensor:
    """fp32 t rounded to the nearest bf16 (ties to even), as fp32 (finite t): by integer
    operations on its bits, which a compiled graph keeps. Inductor does not emulate precision
    casts by default: in a compiled graph t.to(bf16).float() fused into t itself, so a low part
    t - hi came out 0 and the split was one bf16 GEMM (routes differed from eager's on CPU)."""
    bits = t.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)


def split_bf16(t: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) bf16 with hi + lo = t to 16 significant bits (t fp32, finite). Eager, hi is the
    cast (4 kernels in all, against 8 for the integer rounding); compiled, `rounded_to_bf16`
    gives the same bits."""
    if torch.compiler.is_compiling():
        hi = rounded_to_bf16(t)
        return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


def _summed_halves(y: Tensor, dim: int) -> Tensor:
    first, second = y.chunk(2, dim=dim)
    return first + second


class SplitBf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        hi, lo = split_bf16(weight)
        return _summed_halves(mm_fp32(x, torch.cat([hi, lo]).t()), dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        g_hi, g_lo = split_bf16(grad.float())
        # One copy of the splits serves both GEMMs: dx's operand [g_hi | g_lo | g_hi], whose
        # first 2E columns are dW's [g_hi | g_lo] (a strided view, which cuBLAS reads as is).
        g_split = torch.cat([g_hi, g_lo, g_hi] if ctx.needs_input_grad[0] else [g_hi, g_lo], dim=1)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_hi, w_lo = split_bf16(weight)
            # One bf16 GEMM: fp32 accumulation rounded once to x's dtype, as an fp32 output cast
            # after would be, without writing and re-reading that fp32 [N, d] product. (cuBLAS
            # may sum split-K partials in bf16, as in every bf16 linear's input gradient; the GPU
            # test's bound holds at E 64 and 896.)
            grad_x = torch.mm(g_split, torch.cat([w_hi, w_hi, w_lo]))
        if ctx.needs_input_grad[1]:
            grad_w = _summed_halves(mm_fp32(g_split[:, :2 * grad.shape[1]].t(), x), dim=0)
        return grad_x, grad_w


def split_bf16_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, d] bf16, weight [E, d] fp32 -> x @ weightᵀ [N, E] fp32 (see the module docstring)."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise ValueError(f"split_bf16_linear takes bf16 x and an fp32 weight, got {x.dtype} and "
                         f"{weight.dtype}")
    return SplitBf16Linear.apply(x, weight)
