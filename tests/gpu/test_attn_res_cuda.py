"""The AttnRes site's Triton op on CUDA (`pytest -m gpu`): against the float64 reference at the
proxy's width (rows 4096, d 2048, source 0 fp32 and the rest bf16, as in training), opcheck
(schema, fake tensors, autograd, AOT dispatch), and `torch.compile(fullgraph=True)` of the
dispatcher, forward and backward, against eager.

Bounds (relative RMS error): the output and every fp32 gradient (source 0, query, gain) are
fp32 sums over d = 2048 (and, for query and gain, over rows × n) of exact inputs: a few 1e-7
to 1e-6 (the fp32 PyTorch reference at rows 1024 gives ≤ 1.8e-6 against float64), bound
FP32_RTOL = 1e-5. A bf16 source's gradient is rounded to nearest bf16 once: 1.7e-3 relative RMS
for Gaussian values, bound BF16_GRAD_RTOL = 3e-3 (a truncating store would reach ~3.4e-3).
"""

import pytest
import torch

from tests.metrics import rel_rms
from titan_moe.ops.attn_res import (
    attn_res_mix,
    attn_res_mix_naive,
    attn_res_mix_triton,
    uses_triton,
)
from titan_moe.ops.attn_res.attn_res_triton import attn_res_fwd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP32_RTOL = 1e-5
BF16_GRAD_RTOL = 3e-3
COMPILED_RTOL = 1e-6  # the same kernels; only PyTorch's glue (u = γ ⊙ w, the du sum) may differ
EPS = 1e-6


def make_inputs(rows: int, dim: int, n: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtypes = [torch.float32] + [torch.bfloat16] * (n - 1)
    sources = [(torch.randn(rows, dim, device="cuda", generator=gen) * (0.5 + i)).to(d)
               for i, d in enumerate(dtypes)]
    # Scores of a few units: p far from uniform, so every term of the backward matters.
    query = 0.05 * torch.randn(dim, device="cuda", generator=gen)
    gain = torch.rand(dim, device="cuda", generator=gen) + 0.5
    grad_out = torch.randn(rows, dim, device="cuda", generator=gen)
    return sources, query, gain, grad_out


def _grads(fn, sources, query, gain, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in [*sources, query, gain]]
    out = fn(leaves[:-2], leaves[-2], leaves[-1], EPS)
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


@pytest.mark.parametrize("n", [1, 5, 9])
def test_op_matches_float64_reference(n):
    sources, query, gain, grad_out = make_inputs(4096, 2048, n)
    assert uses_triton(sources)
    out, grads = _grads(attn_res_mix_triton, sources, query, gain, grad_out)
    want, want_grads = _grads(attn_res_mix_naive, [v.double() for v in sources], query.double(),
                              gain.double(), grad_out.double())
    assert out.dtype == torch.float32
    assert rel_rms(out, want) <= FP32_RTOL
    for i, (got, expected) in enumerate(zip(grads, want_grads, strict=True)):
        bf16 = got.dtype == torch.bfloat16
        assert got.dtype == ([*sources, query, gain][i]).dtype
        assert rel_rms(got, expected) <= (BF16_GRAD_RTOL if bf16 else FP32_RTOL), (i, bf16)


def test_opcheck_on_cuda():
    sources, query, gain, _ = make_inputs(37, 96, 3)
    args = ([v.requires_grad_() for v in sources], query.requires_grad_(), gain.requires_grad_(),
            EPS, torch.bfloat16)
    torch.library.opcheck(attn_res_fwd, args)


def test_output_in_the_sources_dtype_is_the_fp32_output_rounded():
    # What the model's site asks for: the op writes bf16 and reads a bf16 gradient, where the
    # site used to cast an fp32 output (and autograd its gradient back to fp32). Both round the
    # same fp32 values to nearest once, and a bf16 gradient widens exactly: bit for bit equal.
    sources, query, gain, grad_out = make_inputs(4096, 2048, 5, seed=2)
    sources = [v.bfloat16() for v in sources]
    leaves = [x.detach().clone().requires_grad_() for x in [*sources, query, gain]]
    cast = attn_res_mix_triton(leaves[:-2], leaves[-2], leaves[-1], EPS).bfloat16()
    cast_grads = torch.autograd.grad(cast, leaves, grad_out.bfloat16())
    direct = attn_res_mix_triton(leaves[:-2], leaves[-2], leaves[-1], EPS,
                                 out_dtype=torch.bfloat16)
    direct_grads = torch.autograd.grad(direct, leaves, grad_out.bfloat16())
    assert direct.dtype == torch.bfloat16 and torch.equal(direct, cast)
    for got, want in zip(direct_grads, cast_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 5, 9])
def test_dispatcher_compiles_fullgraph_and_matches_eager(n):
    sources, query, gain, grad_out = make_inputs(1000, 2048, n, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: attn_res_mix(*a), fullgraph=True)
    out, grads = _grads(compiled, sources, query, gain, grad_out)
    want, want_grads = _grads(attn_res_mix, sources, query, gain, grad_out)
    assert rel_rms(out, want) <= COMPILED_RTOL
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.dtype == expected.dtype
        assert rel_rms(got, expected) <= COMPILED_RTOL
