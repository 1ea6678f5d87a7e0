"""The GEMM merge pass on CUDA (`pytest -m gpu`): LatentMoE in bf16 at bench/moe.py's d 512 shape
(2,048 tokens), compiled with the pass, against eager.

On CUDA the router's GEMM is `mm.dtype` (bf16 operands, fp32 output) beside the bf16 GEMMs of
W_down and the shared expert's W1 and W3: all four read x, and merge across output dtypes into
one fp32-output GEMM forward, one for their weight gradients and one for x's gradient (3 + 3 + 3
GEMMs fewer). Tolerance: BF16_RTOL of the largest magnitude, as the other CUDA parity tests;
compiled and eager differ in summation order and in where bf16 rounds.
"""

import pytest
import torch

from compile_passes.registry import inductor_options, matched_counts
from tests.gpu.bf16_tolerance import BF16_RTOL, max_relative_error
from titan_moe.model.moe import LatentMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_latent_moe_with_merged_gemms_matches_eager_on_cuda():
    torch.manual_seed(0)
    layer = LatentMoE(dim=512, n_experts=128, top_k=4, n_shared=1, latent_dim=512,
                      expert_hidden=256, shared_hidden=256)
    layer.init_weights(0.02, 0.02)
    layer = layer.cuda().bfloat16()
    layer.router.float()
    x = torch.randn(1, 2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    leaves = [x, *(p for p in layer.parameters() if p.requires_grad)]
    eager = [layer(x), *torch.autograd.grad(layer(x), leaves, grad)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_layer = torch.compile(layer, fullgraph=True, options=inductor_options(["gemm_merge"]))
    out = compiled_layer(x)
    compiled = [out, *torch.autograd.grad(out, leaves, grad)]
    assert matched_counts()["gemm_merge"] >= 9, matched_counts()
    for c, e in zip(compiled, eager, strict=True):
        assert max_relative_error(c, e) < BF16_RTOL, (tuple(e.shape), max_relative_error(c, e))
