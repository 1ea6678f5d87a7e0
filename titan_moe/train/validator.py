"""The TrainSpec `build_validator_fn`: the validation loss, with or without pipeline parallelism.

torchtitan 0.2.2's Validator reads its batches from Hugging Face datasets and asks the model for
attention masks; titan_moe has neither. This one reads the `validation.*` split of titan_moe's
corpus (data/dataloader.py) and reports, every `validation.freq` steps (and at step 1), the mean
over `validation.steps` batches (the next ones of a loop over the split each time; with -1 the
whole split) of each batch's summed cross-entropy over its global count of labelled tokens: the
training loss's reduction (sum(CE) / global tokens, summed over the data ranks).

Without PP the whole model runs on the batch with the full-logits loss the validator is built
with (the trainer swaps its own for the chunked one afterwards). Under PP the batch goes through
the training schedule's `eval` (forward only), whose loss is the trainer's `TokenMeanLoss`: its
token count is set to the validation batch's global count for the call and restored after, and
with `training.loss_chunk` the last stage returns its normed hidden states
(`head_returns_hidden`, set by the trainer) and the loss applies the head by chunks, a sum of the
same products as the full logits' (chunked_loss.py). Only the ranks holding the last stage hold
a loss; the others add 0 to the sum over the pipeline, so every rank logs the same value. The
schedule splits a validation batch into the training step's micro-batches, which is why config.py
requires the validation batch's shape to be the training one's under PP.

Validation leaves training as it found it: no gradient (no_grad), the modules back in the mode
they were in, the global RNG forked (the training draws the same numbers with or without it),
its own dataloader (the training iterator does not advance), and the routers count no
Quantile Balancing statistics in eval mode (model/router.py).
"""

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import BaseValidator
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_moe.data.dataloader import build_validation_dataloader
from titan_moe.parallel.pipeline import stage_inputs
from titan_moe.parallel.pipeline_schedule import schedule_loss

Context = Callable[[], AbstractContextManager[Any]]


class TitanMoEValidator(BaseValidator):
    """The validation loss of `validation.steps` batches (all of the split with -1)."""

    def __init__(
        self,
        job_config: JobConfig,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        parallel_dims: ParallelDims,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        validation_context: Context,
        maybe_enable_amp: AbstractContextManager[Any],
        metrics_processor: MetricsProcessor,
        pp_schedule: _PipelineSchedule | None = None,
        pp_has_first_stage: bool | None = None,
        pp_has_last_stage: bool | None = None,
    ) -> None:
        super().__init__(job_config)
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = bool(pp_has_first_stage)
        self.pp_has_last_stage = bool(pp_has_last_stage)
        # The trainer's hidden_from_head under PP with the chunked loss (set after it builds
        # the schedule's loss); the full logits otherwise.
        self.head_returns_hidden: Context = contextlib.nullcontext
        steps = job_config.validation.steps
        if steps == -1 and parallel_dims.dp_enabled:
            # Each rank stops at the end of its own share; collectives then wait on the others.
            logger.warning("validation.steps = -1 with data parallelism: data ranks whose "
                           "shares of the split differ in batches will hang")
        # With validation.steps > 0 the loader loops over the split and each validation reads
        # the next batches; with -1 it reads the whole split, from its start, every time.
        with torch.random.fork_rng(devices=[]):
            self.dataloader = build_validation_dataloader(dp_world_size, dp_rank, tokenizer,
                                                          job_config, infinite=steps != -1)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        """Log `validation_metrics/loss` at `step` on every rank."""
        device = next(model_parts[0].parameters()).device
        modes = [part.training for part in model_parts]
        for part in model_parts:
            part.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                loss = self._mean_loss(model_parts, device)
        finally:
            for part, mode in zip(model_parts, modes, strict=True):
                part.train(mode)
        self.metrics_processor.log_validation(loss=loss, step=step)

    def _mean_loss(self, model_parts: list[nn.Module], device: torch.device) -> float:
        steps = self.job_config.validation.steps
        losses: list[torch.Tensor] = []
        for input_dict, labels in self.dataloader:
            if steps != -1 and len(losses) >= steps:
                break
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            tokens = (labels != IGNORE_INDEX).sum().float()
            if self.parallel_dims.dp_enabled:
                dist.all_reduce(tokens, group=self.parallel_dims.get_mesh("batch").get_group())
            with self.validation_context():
                if self.parallel_dims.pp_enabled:
                    losses.append(self._pipeline_loss(input_dict, labels, tokens, device))
                else:
                    with self.maybe_enable_amp:
                        logits = model_parts[0](input_dict["input"], **{
                            k: v for k, v in input_dict.items() if k != "input"})
                    losses.append(self.loss_fn(logits, labels).float() / tokens)
        if not losses:
            raise RuntimeError("the validation split gave no batch")
        loss = torch.stack(losses).sum() / len(losses)
        # Each data rank holds its rows' share of every batch's global mean, and only the last
        # stage's ranks hold one (the other pipeline ranks add 0).
        meshes = [name for name, on in (("batch", self.parallel_dims.dp_enabled),
                                        ("pp", self.parallel_dims.pp_enabled)) if on]
        for name in meshes:
            dist.all_reduce(loss, group=self.parallel_dims.get_mesh(name).get_group())
        return loss.item()

    def _pipeline_loss(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor,
                       tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The batch through the schedule's forward-only `eval`; sum(CE) / global tokens on
        the last stage's ranks, 0 on the others."""
        schedule = self.pp_schedule
        assert schedule is not None
        loss_fn = schedule_loss(schedule)
        first = self.pp_has_first_stage
        token_ids, first_stage, every_stage = stage_inputs(input_dict)
        inputs = (token_ids,) if first else ()
        # Every rank passes every stage's inputs (the doc_ids), as the trainer does.
        extra = {**(first_stage if first else {}), **every_stage}
        last = self.pp_has_last_stage
        micro_losses: list[torch.Tensor] | None = [] if last else None
        training_tokens, loss_fn.tokens = loss_fn.tokens, tokens
        try:
            with self.head_returns_hidden():
                # eval() passes return_outputs on to step(): the last stage merges no outputs
                # (the whole batch's logits without loss_chunk).
                schedule.eval(*inputs, **extra, target=labels if last else None,
                              losses=micro_losses, return_outputs=False)
        finally:
            loss_fn.tokens = training_tokens
        if micro_losses is None:
            return torch.zeros((), device=device)
        return torch.stack(micro_losses).sum().float().to(device)


def build_validator(**kwargs: Any) -> TitanMoEValidator:
    """TrainSpec `build_validator_fn` (torchtitan passes its arguments by keyword)."""
    return TitanMoEValidator(**kwargs)
