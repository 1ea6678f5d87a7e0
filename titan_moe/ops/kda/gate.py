"""KDA lower-bounded forget gate.

    g = g_min * sigmoid(exp(A_log_h) * (g_raw + dt_bias))      in (g_min, 0)

Bounding g below (g_min = -5) is what lets the chunked kernels factor exp(G_r - G_j) into two
rescaled GEMM operands without leaving the fp32 range (see chunk.py).
"""

import torch
from torch import Tensor


def kda_gate(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, g_min: float = -5.0) -> Tensor:
    """g_raw [B,T,H,K], A_log [H], dt_bias [H*K] -> per-channel log-decay g [B,T,H,K].

    Computed and returned in float32 (float64 when g_raw is float64).
    """
    heads, d_k = g_raw.shape[-2:]
    validate_gate_params(heads, d_k, A_log, dt_bias)
    compute = torch.float64 if g_raw.dtype == torch.float64 else torch.float32
    rate = A_log.to(compute).exp()[:, None]
    return g_min * torch.sigmoid(rate * (g_raw.to(compute) + dt_bias.to(compute).view(heads, d_k)))


def validate_gate_params(heads: int, d_k: int, A_log: Tensor, dt_bias: Tensor) -> None:
    """Raise ValueError, naming the parameter, unless A_log is [H] and dt_bias [H*K]."""
    if A_log.shape != (heads,):
        raise ValueError(f"A_log must be [H] = [{heads}], got {list(A_log.shape)}")
    if dt_bias.shape != (heads * d_k,):
        raise ValueError(f"dt_bias must be [H*K] = [{heads * d_k}], got {list(dt_bias.shape)}")
