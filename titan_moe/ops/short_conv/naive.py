"""Short convolution in plain PyTorch: causal depthwise conv, SiLU, optional per-head L2 norm.

    z_t = Σ_j w[:, j] · x_{t−(K−1−j)}     taps before t = 0 or in an earlier document dropped
    a_t = SiLU(z_t)
    y_t = a_t / max(||a_t,h||, eps)       per head h of head_dim channels (q and k of KDA),
                                          F.normalize's semantics, eps = NORM_EPS

The reference for the Triton op (`short_conv_triton.py`) and the path CPU tensors take. Every
step runs in promote(x, weight, fp32) (fp32 for a bf16 x and the fp32 weight, float64 for
float64 inputs) and the result is cast back to x's dtype once: the arithmetic the KDA layer
did before the op existed (its conv promoted to the fp32 weight, SiLU and the norm in fp32).
"""

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6  # F.normalize's eps in the KDA layer


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """y_t = Σ_j weight[:, j] · x_{t−(K−1−j)}, taps from earlier documents (or before 0) dropped.

    x: [B, T, C]; weight: [C, K] (the last tap is the current token); doc_ids: [B, T] or None.
    The result has promote(x, weight)'s dtype.
    """
    k = weight.shape[-1]
    t = x.shape[1]
    padded = F.pad(x, (0, 0, k - 1, 0))
    if doc_ids is not None:
        doc_padded = F.pad(doc_ids, (k - 1, 0), value=-1)
    out = torch.zeros_like(x)
    for j in range(k):
        tap = padded[:, j : j + t] * weight[:, j]
        if doc_ids is not None:
            tap = tap * (doc_padded[:, j : j + t] == doc_ids).unsqueeze(-1).to(x.dtype)
        out = out + tap
    return out


def short_conv_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    head_dim: int | None = None,
) -> torch.Tensor:
    """x [B, T, C], weight [C, K], doc_ids [B, T] or None -> y [B, T, C] in x's dtype.

    head_dim: L2-normalise every head of head_dim channels (None or 0: no norm).
    Differentiable w.r.t. x and weight by autograd.
    """
    wide = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    a = F.silu(causal_depthwise_conv(x.to(wide), weight.to(wide), doc_ids))
    if head_dim:
        a = F.normalize(a.unflatten(-1, (-1, head_dim)), dim=-1, eps=NORM_EPS).flatten(-2)
    return a.to(x.dtype)
