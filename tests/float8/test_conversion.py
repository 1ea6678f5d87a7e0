"""float8/ on CPU (emulated float8): which modules convert, that they compute in float8, and the
hardware errors.

The expected module names are counted by hand from the tiny model's shapes (d 64, KDA inner 64,
gate rank 16, dense hidden 128, latent 32, MLA ranks 32/16): a Linear converts when both its
dims are multiples of 16 and >= filter_min_size and its name is not skipped.
"""

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear
from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

from float8 import check_float8_hardware, convert_dense_linears, convert_routed_experts
from tests.distributed.harness import build_model, global_batch
from titan_moe.model.args import ConfigError
from titan_moe.train.config import Float8

KDA = ["w_q", "w_k", "w_v", "w_g", "w_o"]
SITU = ["w13", "w2"]
# filter_min_size = 64: the 64x64 KDA projections, the 64<->128 dense FFN and the shared experts'
# w13 (64 -> 2·32); the gate (16), beta (2), latent (32), the shared w2 (32 -> 64) and every MLA
# projection (<= 32 on one side) stay; output skipped.
AT_64 = sorted(
    [f"layers.0.mixer.{n}" for n in KDA] + [f"layers.0.ffn.{n}" for n in SITU]
    + [f"layers.1.mixer.{n}" for n in KDA]
    + ["layers.1.ffn.shared.w13", "layers.2.ffn.shared.w13"]
)
# filter_min_size = 32 adds the latent/shared projections and the MLA ones with both dims >= 32.
AT_32 = sorted(
    AT_64
    + ["layers.1.ffn.w_down", "layers.1.ffn.w_up", "layers.1.ffn.shared.w2"]
    + ["layers.2.mixer.w_qa", "layers.2.mixer.w_qb", "layers.2.mixer.w_kva",
       "layers.2.mixer.w_g", "layers.2.mixer.w_o"]
    + ["layers.2.ffn.w_down", "layers.2.ffn.w_up", "layers.2.ffn.shared.w2"]
)


def _converted(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


@pytest.mark.parametrize("min_size,expected", [(64, AT_64), (32, AT_32)])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_dense_conversion_converts_exactly_the_filtered_linears(min_size, expected, recipe):
    model = build_model()
    cfg = Float8(enable=True, recipe=recipe, filter_min_size=min_size, emulate=True)
    names = convert_dense_linears(model, cfg)
    assert sorted(names) == expected
    assert _converted(model) == expected


def test_skip_keeps_named_modules_bf16():
    model = build_model()
    cfg = Float8(enable=True, filter_min_size=32, emulate=True, skip=["output", "w_o"])
    convert_dense_linears(model, cfg)
    assert _converted(model) == [n for n in AT_32 if not n.endswith(".w_o")]


def test_an_empty_skip_list_converts_the_head():
    model = build_model()
    convert_dense_linears(model, Float8(enable=True, filter_min_size=32, emulate=True, skip=[]))
    assert _converted(model) == sorted(AT_32 + ["output"])


def test_emulated_float8_forward_is_close_to_fp32_but_quantized():
    """float8 e4m3 keeps 3 mantissa bits: logits move by a few percent, never by nothing."""
    reference = build_model()
    model = build_model()
    convert_dense_linears(model, Float8(enable=True, filter_min_size=32, emulate=True))
    tokens = global_batch(128)[0][:2, :-1]
    want, got = reference(tokens), model(tokens)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < rel < 0.1, rel
    got.float().square().mean().backward()
    assert model.layers["0"].mixer.w_q.weight.grad is not None


def test_routed_experts_convert_to_float8_grouped_gemm_weights():
    model = build_model()
    names = convert_routed_experts(model, Float8(moe=True, emulate=True))
    assert names == ["layers.1.ffn.experts", "layers.2.ffn.experts"]
    wrapped = sorted(n for n, p in model.named_parameters()
                     if isinstance(p.data, Float8TrainingWeightWrapperTensor))
    assert wrapped == [f"layers.{i}.ffn.experts.{w}" for i in (1, 2) for w in ("w13", "w2")]
    # Our dispatch pads the groups to the float8 kernel's 16 rows; torchao 0.18 cannot pad them.
    assert not any(p.data.config.pad_token_groups_for_grouped_mm
                   for p in model.layers["1"].ffn.experts.parameters())
    assert model.layers["1"].ffn.group_align == 16
    # The CPU grouped GEMM is the exact per-expert fallback: the model still trains.
    model(global_batch(128)[0][:1, :-1]).float().mean().backward()
    assert model.layers["1"].ffn.experts.w13.grad is not None


def test_hardware_errors_name_the_field():
    with pytest.raises(ConfigError, match="float8.emulate = true"):
        check_float8_hardware(Float8(enable=True), "cpu")
    with pytest.raises(ConfigError, match="filter_min_size"):
        check_float8_hardware(Float8(enable=True, filter_min_size=8, emulate=True), "cpu")
    check_float8_hardware(Float8(enable=True, moe=True, emulate=True), "cpu")
    check_float8_hardware(Float8(), "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_config_rejects_float8_on_cpu_without_emulation():
    from titan_moe.train.config import parse_job_config

    with pytest.raises(ConfigError, match="float8"):
        parse_job_config(["--job.config_file", "configs/debug.toml", "--training.device", "cpu",
                          "--float8.enable"])


def test_float8_section_defaults_are_off():
    cfg = Float8()
    assert (cfg.enable, cfg.moe, cfg.emulate) == (False, False, False)
