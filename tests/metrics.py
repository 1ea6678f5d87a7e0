"""Relative errors the tests bound, computed in float64 on the CPU whatever the tensors' dtypes
and devices."""

import torch


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ (Frobenius): the relative RMS error over every element."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the largest error against the largest magnitude."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))
