"""RMSNorm computed in fp32, returned in the input's dtype.

The weights stay fp32 (FSDP keeps every norm in an fp32 unit, fp32_modules.FP32_MODULES), while
under bf16 autocast the activations arrive in bf16. torch's fused rms_norm needs input and weight
of one dtype and otherwise falls back to its unfused composite (with a warning on every call), so
the input is upcast first: one fused fp32 kernel, which is also the precision the norm wants.

`saves_output` (long context, `titan_moe.norm_saves_output`): backward keeps the norm's output y
and rstd instead of its input x, and reads x̂ = x · rstd back as y / w (Apex's and Megatron's
memory-efficient norms do the same). A decoder layer's mixer and FFN keep y anyway (their
segments' and chunks' checkpoints save it), while x, an AttnRes site's output, is saved by the
norm alone: under full AC a layer's recompute then saves two [T, d] tensors fewer (at 512K on
an H100 the step's peak fell by one: bench/RESULTS.md, 2026-12-07). The price: x̂
comes from the rounded output (bf16: 2^-9 relative an element) instead of the exact input, and a
weight element of exactly 0 makes its channel's gradients NaN (0 / 0).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.RMSNorm):
    def __init__(self, dim: int, eps: float | None = None, saves_output: bool = False) -> None:
        super().__init__(dim, eps=eps)
        self.saves_output = saves_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (tests)
        if self.saves_output and torch.is_grad_enabled():
            eps = torch.finfo(wide).eps if self.eps is None else self.eps
            return _RMSNormSavingOutput.apply(x, self.weight, eps)
        weight = None if self.weight is None else self.weight.to(wide)
        return F.rms_norm(x.to(wide), self.normalized_shape, weight, self.eps).to(x.dtype)


class _RMSNormSavingOutput(torch.autograd.Function):
    """y = x · rstd · w over the last dimension, rstd = (mean(x²) + eps)^-1/2, in fp32 at
    least; backward from (y, rstd, w) with x̂ = y / w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        x_wide = x.to(wide)
        rstd = torch.rsqrt(x_wide.square().mean(-1, keepdim=True) + eps)
        y = (x_wide * rstd * weight.to(wide)).to(x.dtype)
        ctx.save_for_backward(y, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, rstd, weight = ctx.saved_tensors
        w = weight.to(rstd.dtype)
        x_hat = y.to(rstd.dtype) / w
        dy_w = dy.to(rstd.dtype) * w
        dx = rstd * (dy_w - x_hat * (dy_w * x_hat).mean(-1, keepdim=True))
        dw = (dy.to(rstd.dtype) * x_hat).flatten(0, -2).sum(0)
        return dx.to(y.dtype), dw.to(weight.dtype), None
