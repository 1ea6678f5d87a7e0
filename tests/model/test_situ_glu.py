import math

import numpy as np
import torch

from titan_moe.model.situ_glu import SiTUGLU, situ, situ_glu

BETA1, BETA2 = 4.0, 25.0
# |h| < β1·β2 = 100 mathematically; in floating point tanh and σ saturate to exactly 1.
H_BOUND = BETA1 * BETA2
# Near 0: β·tanh(x/β) = x·(1 - x²/(3β²) + …), so for |a|, |b| <= 0.1 SiTU-GLU differs from
# SwiGLU silu(a)·b by a relative 0.01/48 + 0.01/1875 ≈ 2.1e-4 at most.
SMALL = 0.1
SWIGLU_REL_TOL = 2.5e-4


def _situ_glu_numpy(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    sigmoid = 1.0 / (1.0 + np.exp(-a))
    return BETA1 * np.tanh(a / BETA1) * sigmoid * BETA2 * np.tanh(b / BETA2)


def test_matches_float64_formula():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 4096, generator=gen) * 8
    expected = _situ_glu_numpy(a.double().numpy(), b.double().numpy())
    got = situ_glu(a, b).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bounded_for_huge_inputs():
    extremes = torch.tensor([-1e4, -1e2, -5.0, 0.0, 5.0, 1e2, 1e4])
    a, b = torch.meshgrid(extremes, extremes, indexing="ij")
    for dtype in (torch.float32, torch.bfloat16):
        h = situ_glu(a.to(dtype), b.to(dtype))
        assert h.dtype == dtype
        assert torch.isfinite(h).all()
        assert h.abs().max().item() <= H_BOUND
    # The bound is approached, not just respected: a = b = 1e4 saturates to β1·β2.
    assert situ_glu(torch.tensor(1e4), torch.tensor(1e4)).item() == H_BOUND
    # SiTU alone is bounded below by -β·σ(x)·tanh: its minimum is a small negative number.
    assert situ(torch.tensor(-1e4), BETA1).item() > -1e-3


def test_bf16_is_computed_in_fp32():
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(2, 1024, generator=gen) * 30).to(torch.bfloat16)
    expected = situ_glu(a.float(), b.float()).to(torch.bfloat16)
    assert torch.equal(situ_glu(a, b), expected)


def test_close_to_swiglu_near_zero():
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.rand(2, 4096, generator=gen, dtype=torch.float64) * 2 - 1) * SMALL
    swiglu = torch.nn.functional.silu(a) * b
    rel = ((situ_glu(a, b) - swiglu).abs() / swiglu.abs().clamp(min=1e-300)).max().item()
    assert rel <= SWIGLU_REL_TOL
    # Far from 0 the two differ a lot, so the check above is not vacuous.
    big = torch.tensor(20.0, dtype=torch.float64)
    assert situ_glu(big, big).item() < 0.5 * (torch.nn.functional.silu(big) * big).item()


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(6, 5, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    b = (torch.randn(6, 5, generator=gen, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b), (a, b))


def test_module_matches_manual_and_gradchecks():
    torch.manual_seed(4)
    block = SiTUGLU(dim=6, hidden_dim=10).double()
    block.init_weights(init_std=0.5, out_init_std=0.25)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w1, w3 = block.w13.weight.detach().chunk(2)  # w13 = [W1; W3]
    a = x.detach().numpy() @ w1.numpy().T
    b = x.detach().numpy() @ w3.numpy().T
    expected = _situ_glu_numpy(a, b) @ block.w2.weight.detach().numpy().T
    np.testing.assert_allclose(block(x).detach().numpy(), expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(block, (x,))


def test_init_weights_stds():
    torch.manual_seed(5)
    block = SiTUGLU(dim=256, hidden_dim=512)
    block.init_weights(init_std=0.02, out_init_std=0.005)
    # Truncation at ±3σ shrinks the std by ~1.3%; 5% covers that and sampling noise.
    w1, w3 = block.w13.weight.chunk(2)
    for w, std in ((w1, 0.02), (w3, 0.02), (block.w2.weight, 0.005)):
        assert math.isclose(w.std().item(), std, rel_tol=0.05)
        assert w.abs().max().item() <= 3 * std
