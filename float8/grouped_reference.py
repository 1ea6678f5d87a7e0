"""torchao 0.18's rowwise float8 grouped GEMM recipe in plain PyTorch: the reference its kernel
is tested against (tests/gpu/test_float8_cuda.py), on any device.

Each GEMM of the recipe quantizes both operands to e4m3 along the dimension it contracts, with a
power-of-two scale per row or column (2^floor(log2(448 / amax))), multiplies, and returns the
input's dtype:
    out    = A  @ B_t     A [M, K] per row,                B_t [E, K, N] per (expert, column)
    dA     = dO @ B_t^T   dO [M, N] per row,               B_t per (expert, row)
    dB_t   = A^T @ dO     A and dO per column within each expert's group of rows
Here every product runs in fp32 on the dequantized operands, so the only error against the bf16
GEMM is the recipe's own rounding; the kernel adds its fp32 accumulation order and Hopper's fast
accumulation on top. Group ends are read on the host: eager, tests only.
"""

import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t rounded to e4m3 along `dim` with power-of-two scales, dequantized to fp32."""
    amax = t.float().abs().amax(dim, keepdim=True).clamp_min(1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    e4m3 = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return e4m3.float() / scale


def _groups(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each group."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return [(e, start, end) for e, (start, end) in enumerate(zip(starts, ends, strict=True))]


class _RowwiseFloat8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b_t, offs)
        out = a.new_zeros(a.shape[0], b_t.shape[-1])
        for e, start, end in _groups(offs):
            out[start:end] = quantized(a[start:end], 1) @ quantized(b_t[e], 0)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        a, b_t, offs = ctx.saved_tensors
        grad_a, grad_b_t = torch.zeros_like(a), torch.zeros_like(b_t)
        for e, start, end in _groups(offs):
            if end == start:
                continue
            grad_a[start:end] = quantized(grad_out[start:end], 1) @ quantized(b_t[e], 1).T
            grad_b_t[e] = quantized(a[start:end], 0).T @ quantized(grad_out[start:end], 0)
        return grad_a, grad_b_t, None


def rowwise_float8_grouped_mm(
    a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """a [M, K], b_t [E, K, N] (same dtype), offs [E] int32 cumulative group ends covering every
    row -> [M, N] in a's dtype, forward and backward as the float8 rowwise recipe rounds them."""
    return _RowwiseFloat8GroupedMM.apply(a, b_t, offs)
