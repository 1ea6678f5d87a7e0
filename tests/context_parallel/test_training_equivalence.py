"""Training with context parallelism: cp = 2 on 2 gloo processes gives the per-step losses and
QB biases of 1 process over 5 AdamW steps (tests/distributed/harness.py).

The cp run is the trainer's path: parallelize_titan_moe applies CP over the cp mesh and FSDP2
over torchtitan's fsdp dim (dp_shard × cp = 2), each rank takes its `shard_batch` slab of the
rows (a document crosses the slab edge), the loss is the chunked LM-head cross-entropy (chunks
of 48 positions, not a divisor of a rank's 256) over the global token count, and QB sums its
histograms over the loss mesh (dp × cp). The reference is one process, unsharded, full logits.

Tolerance: the runs differ in fp32 summation order only (the KDA state scan across slabs, the
chunked loss, the gradient reduce-scatter); 5 Adam steps at lr 1e-3 keep the losses within
rtol 2e-5 (a wrong slab, halo or token count moves them by > 1e-3). QB counts are exact
integers, so the biases agree to the bin interpolation's fp32 rounding (atol 1e-6).

The compiled run is the same layout with `compile.enable` (Inductor with our passes, per
sublayer, the mixers in pieces around their eager collectives), against the same eager
one-process reference and the same tolerances.
"""

import pytest
import torch

from tests.distributed.harness import Layout, train
from tests.distributed.train_jobs import register_harness, shared_runs

# Collectives issued in a different order on the two ranks deadlock: the timeout fails it.
pytestmark = pytest.mark.timeout(1200)

LOSS_RTOL = 2e-5
BIAS_ATOL = 1e-6
SEQ_LEN = 128  # cp × the KDA chunk: each rank holds one whole chunk per row
CP = Layout(2, cp=2, seq_len=SEQ_LEN, loss_chunk=48, name="cp2")
CP_COMPILED = Layout(2, cp=2, seq_len=SEQ_LEN, loss_chunk=48, compile_backend="inductor",
                     name="cp2_compiled")


# Trained with the other test modules' two-process runs, in one launch
# (tests/distributed/train_jobs.py).
register_harness("cp_training", 2, [CP, CP_COMPILED])


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory) -> tuple[dict, dict]:
    results = torch.load(shared_runs(tmp_path_factory)["cp_training"][0] / "results.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks: spinning OpenMP threads slow tiny matmuls
    try:
        reference = train(Layout(1, seq_len=SEQ_LEN))
    finally:
        torch.set_num_threads(threads)
    return results, reference


@pytest.fixture(params=[pytest.param(CP.name, id="eager"),
                        pytest.param(CP_COMPILED.name, id="compiled", marks=pytest.mark.slow)])
def runs(request, all_runs) -> tuple[dict, dict]:
    results, reference = all_runs
    return results[request.param], reference


def test_cp2_losses_match_one_process(runs):
    cp, reference = runs
    torch.testing.assert_close(torch.tensor(cp["losses"]), torch.tensor(reference["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    assert reference["losses"][-1] < reference["losses"][0]


def test_cp2_qb_biases_match_one_process(runs):
    cp, reference = runs
    for step, (got, want) in enumerate(zip(cp["biases"], reference["biases"], strict=True)):
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=BIAS_ATOL,
                                       msg=f"step {step} router {layer}")
        assert any(b.abs().sum() > 0 for b in want)
