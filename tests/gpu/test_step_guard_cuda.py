"""The fused step guard on CUDA (`pytest -m gpu`): torch's CUDA fused AdamW applies the clip
(`grad_scale`) and the skip (`found_inf`), and a step issues no host synchronisation.

References as in tests/train/test_step_guard.py: torch's `clip_grad_norm_` then the for-loop
AdamW on the same GPU, within atol 1e-6, rtol 1e-5 after 3 steps (fp32; the kernels differ in
rounding only); a skipped step leaves weights, Adam state and the QB bias bit-identical.
"""

import math

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as tt_dist_utils

from tests.train.test_step_guard import RoutedLinear, _step, _trace
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.train.optimizer import attach_load_balancing
from titan_moe.train.step_guard import FiniteStepGuard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_guarded(monkeypatch) -> tuple[RoutedLinear, FiniteStepGuard]:
    monkeypatch.setattr(tt_dist_utils, "clip_grad_norm_", tt_dist_utils.clip_grad_norm_)
    model = RoutedLinear().cuda()
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 0.1, "fused": True})
    attach_load_balancing(optimizers, [QuantileBalancer(model)])
    guard = FiniteStepGuard(optimizers, max_consecutive=3)
    assert guard.fused
    return model, guard


def test_a_fused_cuda_step_never_syncs_with_the_host(monkeypatch):
    model, guard = _cuda_guarded(monkeypatch)
    x = torch.randn(32, 8, device="cuda")
    _step(model, guard, 1, x)  # the first step: lazy state and kernel set-up
    guard.settle()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, guard, 2, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.stats() == {"train/skipped_steps": 0}


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipped", "unclipped"])
def test_fused_cuda_clip_matches_torch_clip_then_adamw(monkeypatch, max_norm):
    xs = torch.randn(3, 32, 8, generator=torch.Generator().manual_seed(3)).cuda()
    xs = xs * torch.tensor([1.0, 20.0, 0.05], device="cuda").view(3, 1, 1)
    model, guard = _cuda_guarded(monkeypatch)
    reference = RoutedLinear().cuda()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, foreach=False)
    balancer = QuantileBalancer(reference)
    for step, x in enumerate(xs, 1):
        _step(model, guard, step, x, max_norm=max_norm)
        optimizer.zero_grad()
        reference(x).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        optimizer.step()
        balancer.step()
        torch.testing.assert_close(guard.grad_norm, norm, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_fused_cuda_nan_step_changes_nothing_and_is_counted(monkeypatch):
    model, guard = _cuda_guarded(monkeypatch)
    x1, x2 = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(2)).cuda()
    _step(model, guard, 1, x1)
    before = _trace(model, guard)
    _step(model, guard, 2, x2, nan=True)
    after = _trace(model, guard)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    assert guard.stats() == {"train/skipped_steps": 1}
    assert math.isnan(guard.grad_norm.item())
