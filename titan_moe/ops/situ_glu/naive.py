"""SiTU-GLU in plain PyTorch (spec §5): the reference for the Triton op and the path CPU
tensors and compiled graphs take (compile_passes/situ_glu_fusion.py matches these very ops).

    SiTU_β(a) = β · tanh(a/β) · σ(a)
    h = SiTU_β1(a) ⊙ β2 · tanh(b/β2)
    packed: ab = [a | b] along the last dim (the experts' one GEMM against W1 and W3 stacked)

Computed in promote(a, fp32) (float64 for float64 inputs), returned in a's dtype.
"""

import torch


def situ(x: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU_β(x) = β·tanh(x/β)·σ(x), in the dtype of x."""
    return beta * torch.tanh(x / beta) * torch.sigmoid(x)


def situ_glu_naive(
    a: torch.Tensor, b: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """h = SiTU_β1(a) ⊙ β2·tanh(b/β2), computed in (at least) fp32, returned in a's dtype."""
    compute_dtype = torch.promote_types(a.dtype, torch.float32)
    a32, b32 = a.to(compute_dtype), b.to(compute_dtype)
    return (situ(a32, beta1) * (beta2 * torch.tanh(b32 / beta2))).to(a.dtype)


def situ_glu_packed_naive(
    ab: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """ab [..., 2H] = [a | b] -> h [..., H] = situ_glu_naive(a, b)."""
    a, b = ab.chunk(2, dim=-1)
    return situ_glu_naive(a, b, beta1, beta2)
