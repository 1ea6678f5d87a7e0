"""float8 training with torchao 0.18, applied to a model from outside it (torchtitan style).

    check_float8_hardware(cfg, device_type)   at config time: a ConfigError where it cannot run
    convert_dense_linears(model, cfg)         nn.Linear -> torchao Float8Linear (size-filtered)
    convert_routed_experts(model, cfg)        GroupedExperts weights -> float8 grouped GEMMs

`cfg` is the TOML's `[float8]` section (titan_moe.train.config.Float8). torchtitan 0.2.2's
MoE float8 converter imports a torchao name that 0.18 no longer has, so the experts are converted
here with torchao's `Float8TrainingOpConfig` and `quantize_`.
"""

from float8.dense import convert_dense_linears, dense_linear_filter
from float8.grouped import convert_routed_experts
from float8.hardware import check_float8_hardware

__all__ = [
    "check_float8_hardware",
    "convert_dense_linears",
    "convert_routed_experts",
    "dense_linear_filter",
]
