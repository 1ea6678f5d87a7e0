"""split_bf16_linear on CUDA (`pytest -m gpu`): cuBLAS's bf16 GEMMs with an fp32 output, eager
and compiled by Inductor, against float64 products at the proxy router's shape (T 4096, d 2048,
E 64) and at E 896. Bound as on the CPU (tests/ops/test_split_bf16_linear.py): elementwise
2^-14 (|x| @ |W|ᵀ) for the output and its form for each gradient, dx adding its bf16 rounding.
"""

import pytest
import torch

from tests.ops.test_split_bf16_linear import BOUND, _excess
from titan_moe.ops.split_bf16_linear import split_bf16_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n_experts", [64, 896])
def test_split_gemm_is_fp32_accurate_on_cuda(compiled, n_experts):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(n_experts, 2048, device="cuda", generator=gen)).requires_grad_()
    g = torch.randn(4096, n_experts, device="cuda", generator=gen)
    fn = torch.compile(split_bf16_linear, fullgraph=True) if compiled else split_bf16_linear
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert _excess(y, x64 @ w64.t(), BOUND * (x64.abs() @ w64.abs().t())) <= 1.0
    dx64 = g64 @ w64
    assert _excess(dx, dx64, BOUND * (g64.abs() @ w64.abs()) + 2.0**-8 * dx64.abs()) <= 1.0
    assert _excess(dw, g64.t() @ x64, BOUND * (g64.abs().t() @ x64.abs())) <= 1.0
