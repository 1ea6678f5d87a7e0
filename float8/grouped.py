"""Routed experts to torchao float8 rowwise grouped GEMMs (torchao 0.18 MoE training).

quantize_ wraps each GroupedExperts weight in torchao's Float8TrainingWeightWrapperTensor, whose
torch._grouped_mm override quantizes both operands rowwise and calls the float8 grouped GEMM.
Dropless routing gives groups of any size; the float8 kernel needs every group's row count to be
a multiple of 16. Our dispatch already pads each expert's group (LatentMoE.group_align), so the
conversion raises that alignment to 16 instead of asking torchao to pad: torchao 0.18 asserts
"pad_token_groups_for_grouped_mm=True is not yet supported" (H200, torch 2.11, 2026-12-03).
"""

from typing import Any

import torch.nn as nn
from torchao.prototype.moe_training.config import Float8TrainingOpConfig
from torchao.quantization import quantize_

from titan_moe.model.moe import GroupedExperts

TOKEN_GROUP_ALIGNMENT = 16


def routed_experts_config() -> Float8TrainingOpConfig:
    return Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False)


def convert_routed_experts(model: nn.Module, cfg: Any) -> list[str]:
    """Wrap every GroupedExperts' weights for float8 grouped GEMMs in place; return the names."""
    names = [fqn for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]
    for module in model.modules():
        if isinstance(getattr(module, "experts", None), GroupedExperts):
            module.group_align = max(module.group_align, TOKEN_GROUP_ALIGNMENT)
    quantize_(
        model, routed_experts_config(), filter_fn=lambda m, fqn: isinstance(m, GroupedExperts)
    )
    return names
