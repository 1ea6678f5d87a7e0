"""The pipeline plan (titan_moe/plan/pipeline.py) against hand counts and the plain FSDP plan:
the bytes of a cut, bubbles, micro-batches in flight, and the per-stage memory. Where the cuts go
and what crosses them are the runtime's, tested in tests/distributed/test_pipeline_stages.py."""


import pytest

from titan_moe.model.args import get_flavor
from titan_moe.plan.cli import main
from titan_moe.plan.memory import estimate, parameter_counts
from titan_moe.plan.pipeline import (
    boundary_bytes,
    bubble_fraction,
    in_flight,
    plan_pipeline,
)


def test_boundary_bytes_by_hand():
    args = get_flavor("debug")  # d 256, blocks of 2
    # Entering layer 4 (a block boundary): the embedding, block 1, and block 2 as the partial
    # sum; entering layer 5, block 3's partial sum as well.
    assert boundary_bytes(args, 4, 2, 128) == 3 * 2 * 128 * 256 * 2
    assert boundary_bytes(args, 5, 2, 128) == 4 * 2 * 128 * 256 * 2


def test_bubbles_and_micro_batches_in_flight_by_hand():
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("Interleaved1F1B", 4, 8, virtual=2) == pytest.approx(3 / 19)
    assert bubble_fraction("1F1B", 1, 8) == 0
    with pytest.raises(ValueError, match="allowed 1F1B, Interleaved1F1B"):
        bubble_fraction("GPipe", 2, 4)
    assert [in_flight("1F1B", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1F1B", 4, 0, 2) == 2  # never more than the step has
    assert in_flight("Interleaved1F1B", 4, 0, 16, virtual=2) == pytest.approx(4 * (1 + 3 / 8))


def test_one_stage_is_the_plain_fsdp_plan(tiny):
    """pp = 1 with the whole local batch as one micro-batch is exactly memory.estimate."""
    plan = plan_pipeline(tiny, gpus=4, ep=2, pp=1, microbatch=tiny.local_batch)
    assert plan.fullest == estimate(tiny, 4, 2)
    assert plan.bubble == 0 and plan.boundary_bytes == [] and plan.stages == [range(3)]


def test_two_stages_split_the_parameters_and_send_the_cut(tiny):
    counts = parameter_counts(tiny.args)
    plan = plan_pipeline(tiny, gpus=4, ep=1, pp=2, microbatch=1, counts=counts)
    assert plan.stages == [range(2), range(2, 3)]  # the only block boundary of 3 layers in 2s
    assert plan.boundary_bytes == [boundary_bytes(tiny.args, 2, 1, tiny.seq_len)]
    # Every parameter sits on exactly one stage: the first holds two layers, the embedding and
    # the small rest (final site, norm), the last one layer and the head.
    first = sum(counts.layer_dense[:2]) + sum(counts.layer_experts[:2]) + counts.embedding
    others = (counts.total - sum(counts.layer_dense) - sum(counts.layer_experts)
              - counts.embedding - counts.output)
    last = counts.layer_dense[2] + counts.layer_experts[2] + counts.output
    assert first + others + last == counts.total
    assert plan.fullest.parameters in {4 * (first + others) / 2, 4 * last / 2}  # 2 GPUs a stage


def test_cli_prints_a_pipeline_row_per_degree(tiny, tmp_path, capsys):
    config = tmp_path / "tiny.toml"  # written by the tiny fixture
    assert main(["--config", str(config), "--gpus", "8", "--pp", "1", "2", "4"]) == 0
    out = capsys.readouterr().out
    table = out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.startswith("| pp | GPUs |"))):]
    assert [line.split(" | ")[0] for line in table[2:5]] == ["| 1", "| 2", "| 4"]
    assert table[4].startswith("| 4 | — |")  # more stages than the 3 layers
