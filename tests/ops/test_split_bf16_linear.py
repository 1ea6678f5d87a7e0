"""split_bf16_linear (titan_moe/ops/split_bf16_linear.py) against float64 products.

Bound, elementwise: |y - y64| <= 2^-14 (|x| @ |W|ᵀ) for the output, and the same form for each
gradient (|g| @ |W| for dx, |g|ᵀ @ |x| for dW): the weight's 16-bit split (2^-16), fp32
accumulation over d <= 512 terms and the adds of the halves stay under it. One bf16 GEMM (the
weight rounded to 8 bits) misses it, which the control test shows. dx is returned in bf16, so
its bound adds the bf16 rounding of each element (2^-8 |dx|).
"""

import dataclasses

import pytest
import torch

from titan_moe.model.args import ConfigError, get_flavor
from titan_moe.model.router import Router
from titan_moe.ops.fp32_matmul import mm_fp32
from titan_moe.ops.split_bf16_linear import rounded_to_bf16, split_bf16, split_bf16_linear

BOUND = 2.0**-14


def _inputs(n=96, d=320, e=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (0.05 * torch.randn(e, d, generator=g)).requires_grad_()
    return x.requires_grad_(), w, torch.randn(n, e, generator=g)


def _excess(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest |got - want| / scale (<= 1 within the bound)."""
    return float(((got.detach().double() - want.detach()).abs() / scale.detach()).max())


def test_split_parts_hold_16_significant_bits():
    """The compiled path's integer rounding is torch's round-to-nearest-even bf16 cast (the
    eager path's), over 40 decades, both signs and exact ties; hi + lo holds w to 16
    significant bits."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100_000, generator=g) * torch.logspace(-20, 20, 100_000)
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40800000 + 0x8000], dtype=torch.int32)
    w = torch.cat([w, ties.view(torch.float32)])
    assert torch.equal(rounded_to_bf16(w), w.to(torch.bfloat16).float())
    hi, lo = split_bf16(w)
    assert hi.dtype == lo.dtype == torch.bfloat16
    residual = (w.double() - hi.double() - lo.double()).abs()
    assert float((residual / w.double().abs()).max()) <= 2.0**-16


def test_forward_is_fp32_accurate():
    x, w, _ = _inputs()
    y = split_bf16_linear(x, w)
    assert y.dtype == torch.float32
    want = x.double() @ w.double().t()
    assert _excess(y, want, BOUND * (x.double().abs() @ w.double().abs().t())) <= 1.0


def test_one_bf16_gemm_misses_the_bound():
    """Control: the bound separates the split from a single bf16 GEMM with an fp32 output."""
    x, w, _ = _inputs()
    y = mm_fp32(x, w.detach().to(torch.bfloat16).t())
    want = x.double() @ w.double().t()
    assert _excess(y, want, BOUND * (x.double().abs() @ w.double().abs().t())) > 4.0


def test_gradients_are_fp32_accurate():
    x, w, g = _inputs(seed=1)
    split_bf16_linear(x, w).backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x64 @ w64.t()).backward(g.double())
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    dx_scale = BOUND * (g.double().abs() @ w64.detach().abs()) + 2.0**-8 * x64.grad.abs()
    assert _excess(x.grad, x64.grad, dx_scale) <= 1.0
    dw_scale = BOUND * (g.double().abs().t() @ x64.detach().abs())
    assert _excess(w.grad, w64.grad, dw_scale) <= 1.0


def test_weight_gradient_alone_equals_it_beside_the_input_gradient():
    """Without x's gradient the backward splits g into [g_hi | g_lo] only; with it, dW reads
    the first 2E columns of [g_hi | g_lo | g_hi]. Both must give one dW (1e-6: the GEMMs read
    one operand through a strided view, the other contiguous)."""
    x, w, g = _inputs(seed=3)
    (alone,) = torch.autograd.grad(split_bf16_linear(x.detach(), w), w, g)
    (beside,) = torch.autograd.grad(split_bf16_linear(x, w), w, g)
    torch.testing.assert_close(alone, beside, rtol=1e-6, atol=0)


def test_compiled_equals_eager():
    """Inductor, fullgraph: the autograd.Function traces with no graph break, and the split
    survives fusion (with hi cast to bf16 and back, Inductor dropped the round trip and lo
    became 0: one bf16 GEMM, 9x the bound); tolerance 1e-6 of the largest value (Inductor may
    sum in another order)."""
    x, w, g = _inputs(seed=2)
    eager = [split_bf16_linear(x, w)]
    eager += torch.autograd.grad(eager[0], (x, w), g)
    compiled_fn = torch.compile(split_bf16_linear, fullgraph=True)
    got = [compiled_fn(x, w)]
    got += torch.autograd.grad(got[0], (x, w), g)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.detach().abs().max()))


def test_rejects_other_dtypes():
    x, w, _ = _inputs()
    with pytest.raises(ValueError, match="bf16 x and an fp32 weight"):
        split_bf16_linear(x.float(), w)


def test_router_routes_bf16_activations_as_its_fp32_gemm():
    """The router's two GEMMs agree on the routes (seeded; the logits within the bound)."""
    torch.manual_seed(3)
    fp32, split = Router(256, 64, 8, gemm="fp32"), Router(256, 64, 8)
    fp32.init_weights(0.02)
    split.load_state_dict(fp32.state_dict())
    x = torch.randn(512, 256).to(torch.bfloat16)
    ids_fp32, weights_fp32 = fp32(x)
    ids_split, weights_split = split(x)
    assert torch.equal(ids_split, ids_fp32)
    torch.testing.assert_close(weights_split, weights_fp32, rtol=1e-5, atol=0)


def test_router_gemm_is_validated():
    with pytest.raises(ConfigError, match=r"titan_moe\.router_gemm = 'bf16': must be one of"):
        dataclasses.replace(get_flavor("debug"), router_gemm="bf16").validate()
    with pytest.raises(ValueError, match="gemm must be one of"):
        Router(8, 4, 2, gemm="tf32")
