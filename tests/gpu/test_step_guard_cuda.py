"""The fused step guard on CUDA (`pytest -m gpu`): torch's CUDA fused AdamW applies the clip
(`grad_scale`) and the skip (`found_inf`), and a step issues no host synchronisation.

References as in tests/train/test_step_guard.py: torch's `clip_grad_norm_` then the for-loop
AdamW on the same GPU, within atol 1e-6, rtol 1e-5 after 3 steps (fp32; the kernels differ in
rounding only); a skipped step leaves weights, Adam state and the QB bias bit-identical.
"""

import math

import pytest
import torch

from tests.train.test_step_guard import _guarded, _step, _trace, fused_clip_against_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_fused_cuda_step_never_syncs_with_the_host(monkeypatch):
    model, guard = _guarded(monkeypatch, implementation="fused", device="cuda")
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
    fused_clip_against_reference(monkeypatch, max_norm, "cuda")


def test_a_fused_cuda_nan_step_changes_nothing_and_is_counted(monkeypatch):
    model, guard = _guarded(monkeypatch, implementation="fused", device="cuda")
    x1, x2 = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(2)).cuda()
    _step(model, guard, 1, x1)
    before = _trace(model, guard)
    _step(model, guard, 2, x2, nan=True)
    after = _trace(model, guard)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    assert guard.stats() == {"train/skipped_steps": 1}
    assert math.isnan(guard.grad_norm.item())
