"""The pipeline plan (titan_moe/plan/pipeline.py) against the model itself, brute force and hand
counts: what crosses a stage cut, where the cuts go, bubbles, and the per-stage memory."""

import dataclasses
import itertools

import pytest
import torch

from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.plan.cli import main
from titan_moe.plan.memory import ParamCounts, estimate, parameter_counts
from titan_moe.plan.pipeline import (
    boundary_bytes,
    boundary_tensors,
    bubble_fraction,
    in_flight,
    plan_pipeline,
    stage_layers,
)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_boundary_tensors_are_what_the_model_carries_into_each_layer(block_size):
    """The model's own forward, layer by layer: len(blocks) + the partial sum entering layer i."""
    args = dataclasses.replace(get_flavor("debug"), attn_res_block_size=block_size)
    model = TitanMoE(args)
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    blocks, partial = [], model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        assert boundary_tensors(args, i) == len(blocks) + 1, i
        blocks, partial = layer(blocks, partial, None)
    assert all(t.shape == partial.shape for t in blocks)


def test_boundary_bytes_by_hand():
    args = get_flavor("debug")  # d 256, blocks of 2
    # Entering layer 4 (a block boundary): the embedding, block 1, and block 2 as the partial
    # sum; entering layer 5, block 3's partial sum as well.
    assert boundary_bytes(args, 4, 2, 128) == 3 * 2 * 128 * 256 * 2
    assert boundary_bytes(args, 5, 2, 128) == 4 * 2 * 128 * 256 * 2


def _counts(weights: list[int], embedding: int, output: int) -> ParamCounts:
    return ParamCounts(total=sum(weights) + embedding + output, experts=0, embedding=embedding,
                       output=output, largest_layer_dense=max(weights), largest_layer_experts=0,
                       layer_dense=tuple(weights), layer_experts=(0,) * len(weights))


def _brute_force(weights, embedding, output, pp, allowed):
    """The smallest largest stage over every choice of pp - 1 cuts among `allowed`."""
    n, best = len(weights), None
    for cuts in itertools.combinations(allowed, pp - 1):
        edges = [0, *cuts, n]
        stages = [sum(weights[a:b]) + (embedding if a == 0 else 0) + (output if b == n else 0)
                  for a, b in itertools.pairwise(edges)]
        best = max(stages) if best is None else min(best, max(stages))
    return best


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_stages_are_balanced_and_cut_on_blocks_while_there_are_enough(pp):
    args = dataclasses.replace(get_flavor("debug"), n_layers=8, mla_layers=(4, 8),
                               attn_res_block_size=2)  # 4 blocks
    weights, embedding, output = [5, 9, 2, 7, 7, 3, 8, 1], 6, 4
    stages = stage_layers(_counts(weights, embedding, output), args, pp)
    assert len(stages) == pp and stages[0].start == 0 and stages[-1].stop == 8
    assert all(a.stop == b.start and len(a) > 0 for a, b in itertools.pairwise(stages))
    cuts = [s.start for s in stages[1:]]
    allowed = [2, 4, 6] if pp <= 4 else list(range(1, 8))
    assert set(cuts) <= set(allowed)
    largest = max(sum(weights[s.start:s.stop]) + (embedding if s.start == 0 else 0)
                  + (output if s.stop == 8 else 0) for s in stages)
    assert largest == _brute_force(weights, embedding, output, pp, allowed)


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
