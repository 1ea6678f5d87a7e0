"""Pipeline parallelism on paper: stages cut on Block AttnRes boundaries, what crosses a cut, the
bubble of a schedule, and the per-GPU memory of the fullest stage.

What crosses a cut and where the cuts go are the runtime's (`parallel/pipeline.py`): a cut
before layer i sends ceil(i / S) + 1 tensors of [b, T, d] (the embedding, the finished blocks'
sums and the current partial sum), and stages balance parameters, cut on AttnRes block
boundaries while there are at least pp blocks. (The plan weighs the final AttnRes site and
norm, a few thousand parameters, with the first stage's extras; the runtime with the head.)

Schedules (m micro-batches, v virtual stages a rank for the interleaved one). Idle fraction of a
step, and the micro-batches whose activations a stage holds at its peak (1F1B: stage s holds
pp − s; interleaved: the first rank holds pp (1 + (pp − 1) / (pp v)) stage-chunks' worth, as
Megatron-LM counts it):

    1F1B             bubble = (pp − 1) / (m + pp − 1)
    Interleaved1F1B  bubble = (pp − 1) / (v m + pp − 1)

Not counted: the send and receive buffers of a cut (its bytes, twice, per micro-batch in
flight), and the schedule's extra weights copies, if any.
"""

import math
from dataclasses import dataclass

from titan_moe.model.args import TitanMoEArgs
from titan_moe.parallel.pipeline import balanced_stages, boundary_tensors
from titan_moe.plan.config import PlanConfig
from titan_moe.plan.layouts import ep_degrees
from titan_moe.plan.memory import (
    ACT_BYTES,
    Activations,
    Estimate,
    ParamCounts,
    activation_bytes,
    estimate,
    parameter_counts,
)

SCHEDULES = ("1F1B", "Interleaved1F1B")


def boundary_bytes(args: TitanMoEArgs, layer: int, microbatch: int, seq_len: int) -> int:
    """Bytes a cut before `layer` sends forward per micro-batch (the same come back as
    gradients), in the activations' bf16."""
    return (boundary_tensors(args.attn_res_block_size, layer) * microbatch * seq_len
            * args.dim * ACT_BYTES)


def stage_layers(counts: ParamCounts, args: TitanMoEArgs, pp: int) -> list[range]:
    """The runtime's stages (`parallel.pipeline.balanced_stages`) from the plan's counts: the
    embedding and the rest (vision tower, final site, norm) weigh on the first stage, the head
    on the last."""
    weights = [d + e for d, e in zip(counts.layer_dense, counts.layer_experts, strict=True)]
    return balanced_stages(weights, args.attn_res_block_size, pp,
                           counts.embedding + counts.rest, counts.output)


def step_microbatches(cfg: PlanConfig, microbatch: int, microbatches: int | None = None) -> int:
    """A step's micro-batches: the given count, or the local batch's at `microbatch` rows."""
    return microbatches or max(cfg.local_batch // microbatch, 1)


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 2) -> float:
    """The share of a step a rank sits idle in the pipeline's fill and drain."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_parallel_schedule {schedule!r}: allowed {', '.join(SCHEDULES)}")
    chunks = microbatches * (virtual if schedule == "Interleaved1F1B" else 1)
    return (pp - 1) / (chunks + pp - 1)


def in_flight(schedule: str, pp: int, stage: int, microbatches: int, virtual: int = 2) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (never more than the
    step has)."""
    if schedule == "Interleaved1F1B":
        return min(pp * (1 + (pp - 1) / (pp * virtual)), microbatches)
    return min(pp - stage, microbatches)


@dataclass(frozen=True)
class PipelinePlan:
    pp: int
    stages: list[range]
    fullest: Estimate  # the stage with the highest peak, at gpus / pp GPUs
    fullest_stage: int
    bubble: float
    boundary_bytes: list[int]  # per cut, per micro-batch


def stage_counts(counts: ParamCounts, layers: range, n_layers: int) -> ParamCounts:
    """The parameters one stage holds: the embedding, the vision tower and the final site and
    norm (small) on the first, the head on the last."""
    dense = counts.layer_dense[layers.start:layers.stop]
    experts = counts.layer_experts[layers.start:layers.stop]
    first, last = layers.start == 0, layers.stop == n_layers
    embedding = counts.embedding if first else 0
    output = counts.output if last else 0
    return ParamCounts(total=sum(dense) + sum(experts) + embedding + output
                       + (counts.rest if first else 0),
                       experts=sum(experts), embedding=embedding, output=output,
                       largest_layer_dense=max(dense), largest_layer_experts=max(experts),
                       layer_dense=dense, layer_experts=experts)


def stage_activations(cfg: PlanConfig, stages: list[range], microbatch: int,
                      microbatches: int, schedule: str = "1F1B",
                      virtual: int = 2) -> list[Activations]:
    """Each stage's activation bytes at its peak: what one micro-batch saves for backward, for
    each micro-batch it holds then, plus one micro-batch's recompute (and loss, on the last)."""
    n = cfg.args.n_layers
    return [activation_bytes(cfg, layers, microbatch, loss=layers.stop == n,
                             held=in_flight(schedule, len(stages), s, microbatches, virtual))
            for s, layers in enumerate(stages)]


def plan_pipeline(cfg: PlanConfig, gpus: int, ep: int, pp: int, microbatch: int = 1,
                  microbatches: int | None = None, schedule: str = "1F1B", virtual: int = 2,
                  counts: ParamCounts | None = None,
                  activations: list[Activations] | None = None) -> PipelinePlan:
    """Every stage on gpus / pp GPUs (FSDP × EP within the stage) with its activations at its
    peak (`stage_activations`); the stage with the highest peak decides. microbatches: a step's
    micro-batches of `microbatch` rows (default: the local batch's)."""
    if gpus % pp:
        raise ValueError(f"{gpus} GPUs do not split into {pp} pipeline stages")
    m = step_microbatches(cfg, microbatch, microbatches)
    counts = counts or parameter_counts(cfg.args)
    stages = stage_layers(counts, cfg.args, pp)
    if activations is None:
        activations = stage_activations(cfg, stages, microbatch, m, schedule, virtual)
    n = cfg.args.n_layers
    estimates = [estimate(cfg, gpus // pp, ep, stage_counts(counts, layers, n), act)
                 for layers, act in zip(stages, activations, strict=True)]
    fullest = max(range(pp), key=lambda s: estimates[s].peak)
    cuts = [boundary_bytes(cfg.args, layers.start, microbatch, cfg.seq_len)
            for layers in stages[1:]]
    bubble = bubble_fraction(schedule, pp, m, virtual)
    return PipelinePlan(pp, stages, estimates[fullest], fullest, bubble, cuts)


def fewest_gpus_with_pp(cfg: PlanConfig, gpu_mem_gb: float, pp: int, microbatch: int = 1,
                        microbatches: int | None = None, schedule: str = "1F1B",
                        virtual: int = 2, step: int = 8,
                        limit: int = 1 << 16) -> PipelinePlan | None:
    """The smallest multiple of lcm(step, pp) GPUs whose fullest stage fits, over EP degrees."""
    m = step_microbatches(cfg, microbatch, microbatches)
    counts = parameter_counts(cfg.args)
    stages = stage_layers(counts, cfg.args, pp)
    activations = stage_activations(cfg, stages, microbatch, m, schedule, virtual)
    unit = math.lcm(step, pp)
    for gpus in range(unit, limit + 1, unit):
        plans = [plan_pipeline(cfg, gpus, ep, pp, microbatch, m, schedule, virtual, counts,
                               activations) for ep in ep_degrees(gpus // pp, cfg.args.n_experts)]
        best = min(plans, key=lambda p: p.fullest.peak)
        if best.fullest.fits(gpu_mem_gb):
            return best
    return None
