"""RMSNorm computed in fp32, returned in the input's dtype.

The weights stay fp32 (FSDP keeps every norm in an fp32 unit, fp32_modules.FP32_MODULES), while
under bf16 autocast the activations arrive in bf16. torch's fused rms_norm needs input and weight
of one dtype and otherwise falls back to its unfused composite (with a warning on every call), so
the input is upcast first: one fused fp32 kernel, which is also the precision the norm wants.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (tests)
        weight = None if self.weight is None else self.weight.to(wide)
        return F.rms_norm(x.to(wide), self.normalized_shape, weight, self.eps).to(x.dtype)
