"""Dense linears to torchao Float8Linear, behind a size filter."""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def dense_linear_filter(cfg: Any) -> Callable[[nn.Module, str], bool]:
    """Which nn.Linear modules go float8: both dims multiples of 16 (a float8 GEMM rule), both
    at least `filter_min_size` (smaller ones lose more to the casts than the GEMM gains), and the
    name not ending in one of `skip` (the LM head by default)."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(fqn == s or fqn.endswith("." + s) for s in cfg.skip):
            return False
        dims = (module.in_features, module.out_features)
        return all(d % 16 == 0 and d >= cfg.filter_min_size for d in dims)

    return keep


def convert_dense_linears(model: nn.Module, cfg: Any) -> list[str]:
    """Swap the filtered nn.Linear modules for Float8Linear in place; return their names."""
    keep = dense_linear_filter(cfg)
    names = [fqn for fqn, m in model.named_modules() if keep(m, fqn)]
    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    if cfg.emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return names
