"""FSDP2, EP + FSDP2 and SimpleFSDP on 2 and 4 gloo processes against one process: same
per-step losses over 5 steps and the same QB biases.

SimpleFSDP compiled whole (aot_eager, no passes) also matches on CPU gloo, but its cold compile
adds about 30 s, so CI runs it eager; its bucketing passes estimate collective times from the
GPU's bandwidth (they ask triton for a CUDA driver) and run on CUDA only
(tests/gpu/test_simple_fsdp_cuda.py).

Tolerance: the runs differ only in fp32 summation order (gradient reduce-scatters, the EP
all-to-all regrouping the expert GEMMs), a few ulps per step; 5 Adam steps at lr 1e-3 keep the
losses within rtol 2e-5 of each other (an error in sharding or dispatch moves them by > 1e-3).
QB counts are exact integers, so the biases agree to the bin interpolation's fp32 rounding.
"""

import pytest
import torch

from tests.distributed.harness import Layout, train
from tests.distributed.train_jobs import register_harness, shared_runs

LOSS_RTOL = 2e-5
BIAS_ATOL = 1e-6

LAYOUTS = {
    2: [Layout(2, name="fsdp2"), Layout(2, ep=2, ac="full", name="ep2_efsdp1_ac_full"),
        Layout(2, sharding="simple_fsdp", name="simple_fsdp2")],
    4: [Layout(4, name="fsdp4"),
        Layout(4, ep=2, ac="selective", selective_ac_option="op", name="ep2_efsdp2_ac_op")],
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(Layout(1))


# Trained with the other test modules' runs of the same process count, in one launch
# (tests/distributed/train_jobs.py).
for _world_size, _layouts in LAYOUTS.items():
    register_harness(f"parallel_equivalence/{_world_size}", _world_size, _layouts,
                     island_dtypes=_world_size == 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    runs = shared_runs(tmp_path_factory)
    return {n: torch.load(runs[f"parallel_equivalence/{n}"][0] / "results.pt") for n in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("world_size,name", [(n, lay.name) for n in LAYOUTS for lay in LAYOUTS[n]])
def test_losses_and_qb_biases_match_one_process(results, reference, world_size, name):
    run = results[world_size][name]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    assert reference["losses"][-1] < reference["losses"][0]
    for step, (got, want) in enumerate(zip(run["biases"], reference["biases"], strict=True)):
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=BIAS_ATOL,
                                       msg=f"step {step} router {layer}")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", "simple_fsdp"])
def test_fp32_islands_under_bf16_sharding(results, sharding):
    assert results[2][f"dtypes_{sharding}"] == {
        "attn_res.query": "torch.float32", "router.weight": "torch.float32",
        "ffn_norm.weight": "torch.float32", "w_down.weight": "torch.bfloat16",
    }
