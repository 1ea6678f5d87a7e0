"""The TrainSpec `pipelining_fn`: a TitanMoE as pipeline stages on torchtitan 0.2.2's schedules.

`parallelism.pipeline_parallel_degree` = pp ranks each run `stages_per_rank` stages: 1 for
1F1B, 2 for Interleaved1F1B (or n_layers / `pipeline_parallel_layers_per_stage` stages in all).
The pp × stages_per_rank stages are `model_stages` (parallel/pipeline.py): contiguous layer
ranges of balanced parameter count, cut on AttnRes block boundaries whenever there are at least
as many blocks as stages, else between any two layers (the cut then also sends the unfinished
block's partial sum). Rank r holds stages r, r + pp, ... (torch's looped order), each a
StageModule parallelized like a whole model (`parallelize_fn`: EP, AC, compile, FSDP2).

The loss. torchtitan's non-pipelined step backpropagates sum(CE) / the global batch's token
count; its pipelined step backpropagates each micro-batch's sum(CE) unscaled (scale_grads=False)
and divides only the logged loss. `TokenMeanLoss` divides inside the schedule, so the gradients
are one process's (the trainer sets its token count every step and logs the sum it returns).
With `training.loss_chunk` > 0 the trainer puts the chunked LM-head cross-entropy
(train/chunked_loss.py, with the last stage's head weight) inside the TokenMeanLoss of the rank
holding the last stage and runs the schedule inside `hidden_from_head`, so the last stage returns
the normed hidden states [mb, T, d] (what torch's first-step shape inference then records as its
output) and the [T, vocab] logits never exist.

Start-up logs the bytes each cut sends forward per micro-batch (`boundary_bytes`).
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule
from torchtitan.tools.logging import logger

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.model.router import Router
from titan_moe.parallel.pipeline import (
    EVERY_STAGE_INPUTS,
    StageModule,
    boundary_bytes,
    model_stages,
)

# Schedules whose stage placement is torch's looped one (rank r: stages r, r + pp, ...), the
# ones tested against one process (tests/distributed/test_pipeline_trainer.py).
PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B")


def single_stage_schedule(schedule: str) -> bool:
    """Whether a schedule runs one stage per rank (1F1B) rather than several (Interleaved1F1B)."""
    return issubclass(get_schedule_class(schedule), PipelineScheduleSingle)


def stages_per_rank(schedule: str, pp: int, n_layers: int, layers_per_stage: int | None) -> int:
    """Stages a rank runs: 1 for a single-stage schedule; for a multi-stage one, 2, or
    ceil(n_layers / layers_per_stage) / pp when `pipeline_parallel_layers_per_stage` is set."""
    if single_stage_schedule(schedule):
        return 1
    if layers_per_stage is None:
        return 2
    return math.ceil(n_layers / layers_per_stage) // pp


class TokenMeanLoss:
    """A micro-batch's summed loss over the global batch's token count (`tokens`, set by the
    trainer each step), the scale of the non-pipelined step's loss."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.tokens: torch.Tensor | None = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tokens is None:
            raise RuntimeError("TokenMeanLoss.tokens is unset: the trainer sets it every step")
        return self.loss_fn(pred, labels) / self.tokens


def schedule_loss(schedule: _PipelineSchedule) -> TokenMeanLoss:
    """The loss `schedule` calls on the last stage: the TokenMeanLoss whose token count the
    trainer (each step) and the validator (each batch) set."""
    loss_fn = schedule._loss_fn
    if not isinstance(loss_fn, TokenMeanLoss):
        raise TypeError("the pipeline schedule's loss is not titan_moe's TokenMeanLoss")
    return loss_fn


class RoutedPipelineStage(PipelineStage):
    """torch's PipelineStage over a StageModule. At the first step torch runs each stage once
    more to learn what crosses each cut, which the routers would count as routed tokens in
    their Quantile Balancing statistics; they are cleared after it (before any micro-batch).

    torch 2.13 (`_post_metadata_inference_cleanup`) runs the first stage on the first
    micro-batch and later ones on uninitialised tensors of the received shapes. torch 2.11
    (`_shape_inference`, under no_grad) runs every stage on zeros shaped like its positional
    inputs, the first stage's tokens too, with the micro-batch's keyword inputs. There it gets
    only every stage's keyword inputs (the doc_ids): zero tokens hold no image placeholder for
    the image inputs, which scatter_image_embeddings rightly refuses, and the images only
    replace placeholders' embeddings, so the stage's output shapes are the same without them."""

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self._reset_qb_stats()

    def _shape_inference(self, args: tuple[Any, ...],
                         kwargs: dict[str, Any] | None = None) -> tuple[Any, ...]:
        every_stage = {k: v for k, v in (kwargs or {}).items() if k in EVERY_STAGE_INPUTS}
        outputs = super()._shape_inference(args, every_stage)
        self._reset_qb_stats()
        return outputs

    def _reset_qb_stats(self) -> None:
        for module in self.submod.modules():
            if isinstance(module, Router):
                module.reset_qb_stats()


def activation_dtype(parallel_dims: ParallelDims, job_config: JobConfig) -> torch.dtype:
    """The dtype of the hidden states a stage sends: FSDP2's param dtype under data
    parallelism, else the model's (torchtitan runs pipeline stages without autocast)."""
    sharded = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    name = (job_config.training.mixed_precision_param if sharded
            else job_config.training.dtype)
    return TORCH_DTYPE_MAP[name]


def log_boundary_bytes(stages: list[range], args: TitanMoEArgs, microbatch: int, seq_len: int,
                       dtype: torch.dtype) -> list[int]:
    """Log, and return, the bytes each cut sends forward per micro-batch."""
    sizes = []
    for k, stage in enumerate(stages[1:], start=1):
        size = boundary_bytes(args.attn_res_block_size, stage.start, microbatch, seq_len,
                              args.dim, dtype)
        sizes.append(size)
        where = "block boundary" if stage.start % args.attn_res_block_size == 0 else (
            "inside a block: + its partial sum")
        logger.info(
            f"pipeline cut {k - 1} -> {k} before layer {stage.start} ({where}): "
            f"{size:,} bytes per micro-batch forward ({size / 2**20:.2f} MiB: hidden states "
            f"[{microbatch}, {seq_len}, {args.dim}] {dtype})")
    return sizes


def pipeline_titan_moe(
    model: TitanMoE,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    model_args: TitanMoEArgs,
    parallelize_fn: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[_PipelineSchedule, list[nn.Module], bool, bool]:
    """TrainSpec `pipelining_fn`: (schedule, this rank's parallelized stages, whether it holds
    the first stage, whether it holds the last)."""
    parallelism = job_config.parallelism
    pp_mesh = parallel_dims.get_mesh("pp")
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    per_rank = stages_per_rank(parallelism.pipeline_parallel_schedule, pp, model_args.n_layers,
                               parallelism.pipeline_parallel_layers_per_stage)
    stages = model_stages(model, pp * per_rank)
    logger.info(f"pipeline stages (layers): {[f'{s.start}-{s.stop - 1}' for s in stages]}")
    log_boundary_bytes(stages, model_args, parallelism.pipeline_parallel_microbatch_size,
                       job_config.training.seq_len, activation_dtype(parallel_dims, job_config))
    parts, pipeline_stages = [], []
    for stage_id in range(rank, len(stages), pp):
        part = parallelize_fn(StageModule(model, stages[stage_id]), parallel_dims, job_config)
        parts.append(part)
        pipeline_stages.append(RoutedPipelineStage(part, stage_id, len(stages), device,
                                             group=pp_mesh.get_group()))
    schedule = build_pipeline_schedule(job_config, pipeline_stages, TokenMeanLoss(loss_fn))
    return (schedule, parts, any(s.is_first for s in pipeline_stages),
            any(s.is_last for s in pipeline_stages))
