"""The step guard's fused path (titan_moe/train/step_guard.py: the total grad norm only, the clip
applied inside the fused AdamW kernel) on DTensors: FSDP2 and EP + FSDP2 on 2 gloo processes, and
one process, against one process with torchtitan's clip_grad_norm_ and the for-loop AdamW.

max_norm 0.3 is below every step's norm (about 0.6), so every step clips. Per step the grad norm
before clipping matches the reference's within rtol 1e-5 (the expert and dense norms reduced over
their own meshes and combined); the norm of the gradients the update used (torchtitan's norm of
them after the step: the fused kernel writes back the gradients it divided by grad_scale) is 0.3
within rtol 1e-5, as the reference's clip leaves them; losses and QB biases match within the
parallel-equivalence tolerances (test_parallel_equivalence.py: fp32 summation order only).
"""

import pytest
import torch

from tests.distributed.harness import Layout, train
from tests.distributed.train_jobs import register_harness, shared_runs

MAX_NORM = 0.3
NORM_RTOL = 1e-5
LOSS_RTOL = 2e-5
BIAS_ATOL = 1e-6
LAYOUTS = [Layout(2, fused=True, max_norm=MAX_NORM, name="fsdp2_fused"),
           Layout(2, ep=2, fused=True, max_norm=MAX_NORM, name="ep2_fused")]


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(Layout(1, max_norm=MAX_NORM))


# Trained with the other test modules' two-process runs, in one launch
# (tests/distributed/train_jobs.py).
register_harness("fused_clip", 2, LAYOUTS)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    results = torch.load(shared_runs(tmp_path_factory)["fused_clip"][0] / "results.pt")
    results["one_process_fused"] = train(Layout(1, fused=True, max_norm=MAX_NORM))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS] + ["one_process_fused"])
def test_fused_clip_matches_torchtitans_clip(results, reference, name):
    got, want = results[name], reference
    assert all(norm > MAX_NORM for norm, _ in want["grad_norms"])  # every step clips
    torch.testing.assert_close(got["grad_norms"], want["grad_norms"], rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close([used for _, used in got["grad_norms"]],
                               [MAX_NORM] * len(got["grad_norms"]), rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=LOSS_RTOL, atol=0)
    for step_got, step_want in zip(got["biases"], want["biases"], strict=True):
        for b, r in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(b, r, rtol=0, atol=BIAS_ATOL)
