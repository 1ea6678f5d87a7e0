"""qb_route's Triton op and the LatentMoE layer on CUDA (`pytest -m gpu`).

The op against its PyTorch reference on the same GPU, with the histogram counted both ways (the
cutoffs binned and counted in shared memory by count_bins' CUDA kernel, and the kernel's global
atomics): ids, weights, histogram and load must be equal bit for bit (all compute σ as
1 / (1 + expf(-x)) with an IEEE division, see qb_route_triton.py), at the routing issue's
E = 896, k = 16 and at the proxy's E = 64, k = 8; the weight gradient as relative RMS error,
and compiled, that gradient one kernel (route_weights_grad_triton.py) and nothing else.
count_bins' kernel alone against its reference. The bf16 layer (torch._grouped_mm, padded groups)
against the same layer in float64 on CPU with identical routes forced by a large bias gap (also
in token chunks, long context's `moe_token_chunk`), and its forward and backward free of host
syncs (what CUDA graphs need).
"""

import importlib
import math

import pytest
import torch

from compile_passes.inspect import inspect_compile
from tests.metrics import rel_rms
from titan_moe.model.moe import LatentMoE
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.ops.router import qb_route, qb_route_naive, qb_route_triton
from titan_moe.ops.router.bin_counts import (
    count_bins,
    count_bins_reference,
    shared_counting_available,
)
from titan_moe.ops.router.qb_route_triton import launch_qb_route

# The module, not the op of the same name that titan_moe.ops.router exports.
qb_route_module = importlib.import_module("titan_moe.ops.router.qb_route_triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP32_GRAD_RTOL = 1e-6
BF16_RTOL = 3e-2  # relative RMS error of a bf16 layer against float64


@pytest.mark.parametrize(("n_tokens", "n_experts", "n_bins", "dtype"), [
    (16384, 896, 1000, torch.float32), (4096, 64, 1000, torch.float32),
    (1000, 130, 12288, torch.bfloat16), (3, 5, 1, torch.float32)])
def test_count_bins_kernel_equals_reference(n_tokens, n_experts, n_bins, dtype):
    """The shared-memory kernel (NVRTC) against its reference (torch's σ, qb_histogram), NaN
    cutoffs skipped; at E 130 the last block holds fewer experts than the others, at 12288 bins
    one expert's row fills a block's 48 KB; bf16 logits through the kernel's bf16 build."""
    assert shared_counting_available(torch.device("cuda"), n_bins, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (2 * torch.randn(n_tokens, n_experts, device="cuda", generator=gen)).to(dtype)
    bias = 0.1 * torch.randn(n_experts, device="cuda", generator=gen)
    scores = torch.sigmoid(logits.float())
    alpha = torch.topk(scores + bias, min(2, n_experts)).values[:, -1]
    alpha[::5] = float("nan")  # tokens not counted
    got = count_bins(logits, bias, alpha, n_bins)
    assert torch.equal(got, count_bins_reference(logits, bias, alpha, n_bins))
    assert got.sum().item() == n_experts * int((~torch.isnan(alpha)).sum())


@pytest.mark.parametrize("counting", ["atomic", "shared"])
@pytest.mark.parametrize(("n_tokens", "n_experts", "k", "dtype"), [
    (16384, 896, 16, torch.float32), (4096, 64, 8, torch.float32), (1000, 130, 4, torch.bfloat16),
])
def test_op_equals_reference_on_cuda(n_tokens, n_experts, k, dtype, counting):
    """The kernel with each counting against the reference, bit for bit; the op's gradient
    (its own counting, which the backward does not read) against the reference's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (2 * torch.randn(n_tokens, n_experts, device="cuda", generator=gen)).to(dtype)
    logits[:, ::7] = logits[:, :1]  # ties within every row
    bias = 0.1 * torch.randn(n_experts, device="cuda", generator=gen)
    bias[::7] = bias[0]  # and in s + b
    valid = torch.rand(n_tokens, device="cuda", generator=gen) > 0.1
    got = launch_qb_route(logits, bias, valid, k, 1.0, 1000, True, counting=counting)
    ref = logits.clone().requires_grad_()
    want = qb_route_naive(ref, bias, k, 1.0, 1000, valid)
    for name, g, w in zip(("ids", "weights", "hist", "load"), got, want, strict=True):
        assert torch.equal(g, w.detach()), name
    ours = logits.clone().requires_grad_()
    grad_out = torch.randn(n_tokens, k, device="cuda", generator=gen)
    weights = qb_route_triton(ours, bias, valid, k, 1.0, 1000, True)[1]
    (got_grad,) = torch.autograd.grad((weights * grad_out).sum(), ours)
    (want_grad,) = torch.autograd.grad((want[1] * grad_out).sum(), ref)
    assert rel_rms(got_grad, want_grad) <= FP32_GRAD_RTOL


def test_opcheck_on_cuda():
    logits = torch.randn(64, 32, device="cuda", requires_grad=True)
    bias = torch.zeros(32, device="cuda")
    args = (logits, bias, None, 4, 1.0, 1000, True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(qb_route_triton, args, test_utils=checks)
    # opcheck's test_aot_dispatch_dynamic cannot take this op: it sums the outputs starting
    # from int 0, and the first one (expert ids, int64) makes that sum an integer tensor that
    # the float weights cannot be added to. The same check by hand: AOTAutograd-compiled
    # (dynamic shapes, fullgraph) against eager, outputs bit for bit and the logits' gradient.
    compiled = torch.compile(lambda *a: qb_route_triton(*a), fullgraph=True, dynamic=True)
    grad_out = torch.randn(64, 4, device="cuda")
    want = qb_route_triton(*args)
    (want_grad,) = torch.autograd.grad((want[1] * grad_out).sum(), logits)
    got = compiled(*args)
    (got_grad,) = torch.autograd.grad((got[1] * grad_out).sum(), logits)
    for name, g, w in zip(("ids", "weights", "hist", "load"), got, want, strict=True):
        assert torch.equal(g.detach(), w.detach()), name
    assert rel_rms(got_grad, want_grad) <= 1e-6


def _layer(device: str, dtype: torch.dtype) -> LatentMoE:
    torch.manual_seed(0)
    moe = LatentMoE(dim=256, n_experts=16, top_k=4, n_shared=1, latent_dim=128,
                    expert_hidden=192, shared_hidden=192, group_align=8)
    moe.init_weights(0.05, 0.05)
    with torch.no_grad():
        # A bias gap of 1 decides the routes: bf16 and float64 scores cannot reorder them.
        moe.router.expert_bias.copy_(torch.arange(16).remainder(4).eq(0).float())
    moe = moe.to(device=device, dtype=dtype)
    moe.router.float()
    return moe


@pytest.mark.parametrize("token_chunk", [0, 256], ids=["whole", "chunks-256"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_latent_moe_bf16_on_cuda_matches_float64(compiled, token_chunk):
    """With token chunks (600 tokens in 256, 256, 88), each chunk runs under its own checkpoint,
    traced as a HOP when compiled; the float64 reference runs unchunked."""
    x = torch.randn(2, 300, 256)
    grad_out = torch.randn(2, 300, 256)
    ref = _layer("cpu", torch.float64)
    x_ref = x.double().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * grad_out.double()).sum().backward()

    moe = _layer("cuda", torch.bfloat16)
    moe.token_chunk = token_chunk
    fn = torch.compile(moe, fullgraph=True) if compiled else moe
    x_gpu = x.cuda().bfloat16().requires_grad_()
    out = fn(x_gpu)
    (out.float() * grad_out.cuda()).sum().backward()
    assert torch.isfinite(out).all()
    assert rel_rms(out, out_ref) <= BF16_RTOL
    assert rel_rms(x_gpu.grad, x_ref.grad) <= BF16_RTOL
    params = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        assert rel_rms(p.grad, params[name].grad) <= BF16_RTOL, name


@pytest.mark.parametrize("counting", ["atomic", "shared"])
def test_latent_moe_forward_and_backward_never_sync_with_the_host(monkeypatch, counting):
    """Dispatch, grouped GEMMs and combine keep every shape static and every value on the GPU,
    so the layer can be CUDA-graphed: a host sync inside it (a .item(), nonzero, or a
    device-to-host copy) raises under sync debug mode "error". The first call runs outside
    it: lazy initialisation (cuBLAS handles, Triton's compile, NVRTC's build) may sync once.
    Both countings of the QB histogram, whichever the default picks at this size (the shared
    one launches count_bins through torch's NVRTC launcher)."""
    monkeypatch.setattr(qb_route_module, "default_counting", lambda logits, n_bins: counting)
    moe = _layer("cuda", torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


def test_quantile_balancer_step_never_syncs_with_the_host():
    """The bias update after each optimizer step stays on the GPU (a host read there made the
    GPU idle while the host loaded the next batch); its metrics are read on logging steps."""
    moe = _layer("cuda", torch.bfloat16)
    balancer = QuantileBalancer(moe)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)
        balancer.step()  # outside sync debug mode: lazy initialisation may sync once
        moe(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        balancer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    metrics = balancer.metrics()
    assert len(metrics) == 3 and all(math.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(moe.router.expert_bias).all()


class _RouteWeights(torch.nn.Module):
    def forward(self, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return qb_route(logits, bias, 8)[1]


def test_compiled_logits_gradient_is_the_one_gradient_kernel():
    """Compiled, the logits' gradient is `route_weights_grad_kernel` alone: the backward graph
    has no other kernel (the PyTorch formula compiled to a sum, a [T, E] fill and a scatter),
    and the gradient equals the eager op's within FP32_GRAD_RTOL."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, 64, device="cuda", generator=gen)
    bias = torch.zeros(64, device="cuda")
    compiled_logits = logits.clone().requires_grad_()
    result = inspect_compile(_RouteWeights(), (compiled_logits, bias), steps=1)
    backward = [k.name for k in result.kernels
                if k.unit == "graph0_backward" and k.kind == "generated"]
    assert len(backward) == 1 and backward[0].startswith("route_weights_grad_kernel"), backward
    eager_logits = logits.clone().requires_grad_()
    qb_route(eager_logits, bias, 8)[1].float().square().mean().backward()
    assert rel_rms(compiled_logits.grad, eager_logits.grad) <= FP32_GRAD_RTOL


@pytest.mark.parametrize(("n_experts", "k"), [(896, 16), (4, 2)], ids=["E896-k16", "E4-k2"])
def test_a_row_constant_weight_gradient_gives_exactly_zero_logits_gradient(n_experts, k):
    """The weights sum to ρ in every row, so a gradient constant over a row has ∂L/∂logits = 0:
    in the closed form, g - Σ g s / S is exactly 0 in IEEE arithmetic when g is a power of two
    (which scales the row's sum exactly). Triton's fp32 `/` (div.full.f32, up to 2 ulp) left an
    ulp of noise there, which Adam's ε-sized denominators amplified when the step-guard tests'
    toy loss (Σ weights) trained on it; the kernel's divisions are IEEE ones for that."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = (3 * torch.randn(2048, n_experts, device="cuda", generator=gen)).requires_grad_()
    weights = qb_route(logits, torch.zeros(n_experts, device="cuda"), k, 1.5)[1]
    scale = 2.0 ** torch.randint(-3, 4, (2048, 1), device="cuda", generator=gen)
    (weights * scale).sum().backward()
    assert (logits.grad == 0).all(), logits.grad.abs().max().item()
