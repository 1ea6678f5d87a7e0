"""compile_passes/gemm_merge.py: GEMMs sharing an operand, and summed GEMMs, as one GEMM.

Graph-level tests trace small functions with make_fx (fake tensors, as Inductor's joint graph
has them), run the pass and compare the rewritten graph's outputs with the original's in
float64 (the merged GEMM adds the same products: 1e-12 relative). The layer test compiles
LatentMoE with the pass against eager in fp32 (RTOL as tests/compile/test_passes.py).
"""

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compile_passes import gemm_merge
from compile_passes.inspect import inspect_compile
from compile_passes.registry import matched_counts
from titan_moe.model.moe import LatentMoE

F64_RTOL = 1e-12
RTOL = 1e-5


def _gemms(gm: torch.fx.GraphModule) -> int:
    return sum(gemm_merge.as_gemm(n) is not None for n in gm.graph.nodes)


def _merged(fn, *inputs) -> tuple[int, int, int]:
    """(GEMMs before, after, removed as the pass counts), after checking the rewritten graph
    computes what the original does."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    original = copy.deepcopy(gm)
    removed = gemm_merge.GemmMerge().apply(gm.graph)
    gm.graph.lint()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    for got, want in zip(gm(*inputs), original(*inputs), strict=True):
        assert float((got - want).abs().max() / want.abs().max()) < F64_RTOL
    return _gemms(original), _gemms(gm), removed


def _f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def test_projections_of_one_input_become_one_gemm():
    x, y = _f64(16, 8), _f64(16, 8)
    ws = [_f64(n, 8) for n in (3, 5, 7, 4)]

    def fn(x, y, w1, w2, w3, w4):
        return x @ w1.t(), x @ w2.t(), x @ w3.t(), y @ w4.t()

    assert _merged(fn, x, y, *ws) == (4, 2, 2)  # y's projection has no partner


def test_gemms_against_one_right_operand_become_one_gemm():
    x = _f64(16, 8)
    gs = [_f64(16, n) for n in (3, 5, 6)]

    def fn(x, g1, g2, g3):  # the weight gradients of three linears of x
        return g1.t() @ x, g2.t() @ x, g3.t() @ x

    assert _merged(fn, x, *gs) == (3, 1, 2)


def test_summed_products_become_one_gemm_and_other_terms_stay():
    gs = [_f64(16, n) for n in (3, 5, 6)]
    ws = [_f64(n, 8) for n in (3, 5, 6)]
    residual = _f64(16, 8)

    def fn(g1, g2, g3, w1, w2, w3, residual):  # an input gradient: Σ g_i W_i, plus a residual
        return (g1 @ w1 + residual + g2 @ w2 + g3 @ w3,)

    assert _merged(fn, *gs, *ws, residual) == (3, 1, 2)


def test_a_gemm_reading_another_members_output_is_not_merged():
    x, w1, v = _f64(16, 8), _f64(8, 4), _f64(16, 6)

    def fn(x, w1, v):
        h = x @ w1            # [16, 4]
        return h, x @ (x.t() @ v)  # x @ B, with B = xᵀ v: independent of h, merged with it

    assert _merged(fn, x, w1, v)[1] == 2

    def dependent(x, w1, v):
        h = x @ w1
        return h, x @ (x.t() @ h)  # B = xᵀ h reads h: one merged GEMM would feed itself

    before, after, removed = _merged(dependent, x, w1, v)
    assert (after, removed) == (before, 0)


def test_outputs_of_different_dtypes_are_not_merged_off_cuda():
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    w1, w2 = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)

    def fn(x, w1, w2):
        return x @ w1.t(), x @ w2

    gm = make_fx(fn, tracing_mode="fake")(x, w1, w2)
    gemms = [gemm_merge.as_gemm(n) for n in gm.graph.nodes if gemm_merge.as_gemm(n)]
    # Same dtypes on CPU: one group; an fp32-output member (mm.dtype, CUDA only) would be its own.
    assert len(gemm_merge._compatible(gemms)) == 1
    object.__setattr__(gemms[1], "out_dtype", torch.float32)
    assert gemm_merge._compatible(gemms) == []


@pytest.mark.slow
def test_latent_moe_compiled_with_the_pass_matches_eager():
    torch.manual_seed(0)
    layer = LatentMoE(dim=32, n_experts=4, top_k=2, n_shared=1, latent_dim=16, expert_hidden=8,
                      shared_hidden=8)
    layer.init_weights(0.1, 0.1)
    x = torch.randn(1, 24, 32, requires_grad=True)
    params = [p for p in layer.parameters() if p.requires_grad]
    inspect_compile(layer, (x,), steps=1, passes=["gemm_merge"])
    compiled = [x.grad.clone(), *(p.grad.clone() for p in params)]
    # In fp32 on CPU the router, W_down and the shared W1 and W3 read x: 3 GEMMs fewer forward,
    # 3 fewer for their weight gradients, 3 fewer for x's gradient; more merge in the experts'
    # CPU loop and the W_up / shared W2 backward.
    assert matched_counts()["gemm_merge"] >= 9
    for t in (x, *params):
        t.grad = None
    layer(x).square().mean().backward()
    eager = [x.grad, *(p.grad for p in params)]
    for c, e in zip(compiled, eager, strict=True):
        assert float((c - e).abs().max() / e.abs().max()) < RTOL
