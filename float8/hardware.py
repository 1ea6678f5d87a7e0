"""Where float8 training can run: a clear ConfigError everywhere else."""

from typing import Any

import torch

from titan_moe.model.args import ConfigError

# torch._scaled_mm needs float8 tensor cores (Ada / Hopper and later); torchao's float8 grouped
# GEMM (torch._scaled_grouped_mm) needs Hopper.
DENSE_MIN_CAPABILITY = (8, 9)
GROUPED_MIN_CAPABILITY = (9, 0)


def check_float8_hardware(cfg: Any, device_type: str) -> None:
    """Raise ConfigError unless `[float8]` as configured can run on `device_type`."""
    if not (cfg.enable or cfg.moe):
        return
    if cfg.filter_min_size < 16:
        raise ConfigError(
            f"float8.filter_min_size = {cfg.filter_min_size}: must be >= 16 (float8 GEMMs need "
            "dimensions that are multiples of 16)"
        )
    if device_type != "cuda":
        if not cfg.emulate:
            raise ConfigError(
                "float8.enable / float8.moe need a CUDA GPU of compute capability >= 8.9 "
                f"(>= 9.0 for float8.moe); training.device is {device_type!r}. "
                "Set float8.emulate = true to emulate float8 on CPU (tests only)"
            )
        return
    if cfg.emulate:
        if cfg.moe:
            raise ConfigError(
                "float8.emulate = true with float8.moe = true is CPU-only: torchao's float8 "
                "grouped GEMM has no emulated CUDA path"
            )
        return
    capability = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cfg.enable and capability < DENSE_MIN_CAPABILITY:
        raise ConfigError(
            f"float8.enable = true needs CUDA compute capability >= 8.9; {name} has "
            f"{capability[0]}.{capability[1]}"
        )
    if cfg.moe and capability < GROUPED_MIN_CAPABILITY:
        raise ConfigError(
            f"float8.moe = true needs CUDA compute capability >= 9.0 (Hopper); {name} has "
            f"{capability[0]}.{capability[1]}"
        )
