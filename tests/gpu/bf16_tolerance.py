"""The bf16 tolerance the CUDA parity tests share: error relative to the largest magnitude."""

import torch

BF16_RTOL = 3e-2


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
