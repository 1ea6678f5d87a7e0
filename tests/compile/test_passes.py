"""Each Inductor pass fires (matched count > 0) and keeps compiled results equal to eager."""

import pytest
import torch
import torch.nn as nn

from compile_passes.inspect import inspect_compile
from compile_passes.registry import matched_counts
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.situ_glu import situ_glu

RTOL = 1e-5  # fp32 compiled vs eager, relative to each tensor's largest magnitude


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class _SiTUGLU(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return situ_glu(a, b)


def _compiled_vs_eager(module: nn.Module, inputs: list[torch.Tensor], passes: list[str]):
    result = inspect_compile(module, (inputs,) if isinstance(module, AttnResSite) else
                             tuple(inputs), steps=1, passes=passes)
    compiled = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    out = module(inputs) if isinstance(module, AttnResSite) else module(*inputs)
    out.square().mean().backward()
    return result, compiled, [x.grad for x in inputs]


def test_situ_glu_pass_fires_and_keeps_one_kernel_each_way():
    a, b = (torch.randn(8, 16, requires_grad=True) * 4 for _ in range(2))
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    result, compiled, eager = _compiled_vs_eager(_SiTUGLU(), [a, b], ["situ_glu"])
    assert matched_counts()["situ_glu"] == 1
    for unit in ("graph0_forward", "graph0_backward"):
        generated = [k for k in result.kernels if k.unit == unit and k.kind == "generated"]
        assert len(generated) == 1, generated
        assert "compile_passes.situ_glu" in result.post_grad[unit]
    for c, e in zip(compiled, eager, strict=True):
        assert _rel(c, e) < RTOL


# (site parameters' dtype, sources' dtypes): fp32 alone; the training layout under bf16 autocast
# (an fp32 site, the embedding's fp32 block beside a bf16 partial sum); a model cast whole to bf16.
SITE_LAYOUTS = {
    "fp32": (torch.float32, [torch.float32] * 3),
    "autocast": (torch.float32, [torch.float32, torch.bfloat16]),
    "bf16": (torch.bfloat16, [torch.bfloat16] * 3),
}


@pytest.mark.parametrize("layout", SITE_LAYOUTS)
def test_attn_res_pass_fires_and_preserves_gradients(layout):
    param_dtype, dtypes = SITE_LAYOUTS[layout]
    site = AttnResSite(16).to(param_dtype)
    with torch.no_grad():
        site.query.normal_()
    sources = [torch.randn(2, 4, 16, dtype=d, requires_grad=True) for d in dtypes]
    result, compiled, eager = _compiled_vs_eager(site, sources, ["attn_res"])
    assert matched_counts()["attn_res"] == 1
    assert "aten.mv" not in result.post_grad["graph0_forward"]
    for c, e in zip(compiled, eager, strict=True):
        # Gradients of bf16 sources are rounded to bf16 at the end: one rounding apart.
        assert _rel(c, e) < (RTOL if c.dtype == torch.float32 else 1e-2)


def test_kda_gate_replacement_equals_the_gate_cumsum_in_float64():
    from compile_passes.kda_gate_cumsum_fusion import _search, gate_chunk_cumsum

    g_raw = torch.randn(2, 128, 2, 16, dtype=torch.float64)
    A_log, dt_bias = torch.randn(2, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    want = _search(g_raw, A_log, dt_bias, -5.0)
    got = gate_chunk_cumsum(g_raw, A_log, dt_bias, -5.0)
    assert _rel(got, want) < 1e-12  # float64: only summation order differs


def test_unknown_pass_name_is_a_clear_error():
    from titan_moe.parallel.parallelize import apply_compile

    with pytest.raises(ValueError, match="compile.passes: unknown pass 'fuse_all'; allowed"):
        apply_compile(nn.Module(), "inductor", set(), passes=["fuse_all"])
