"""Finite-or-stop training: no optimizer step and no checkpoint from non-finite numbers.

torchtitan 0.2.2's `train_step` runs forward/backward per microbatch, clips the gradients
(`clip_grad_norm_` returns the global norm: a DTensor norm is reduced with `full_tensor()`, so
every rank holds the same value), then calls `optimizers.step()` and `lr_schedulers.step()`.
`FiniteStepGuard` stands in for the clip (to keep the norm, which train_step holds in a local) and
for `optimizers.step()`: when the step's loss or grad norm is not finite on any rank (one
all-reduced flag, so every rank takes the same decision; reading it is one host sync per step),
it skips the optimizer step, zeroes the gradients and discards the step's Quantile Balancing
histograms instead of applying them (the balancers run as the optimizer's post-step hook).
The LR schedule still advances: it follows the step count, and the skipped step's batch is
consumed. `max_consecutive` skipped steps in a row raise `NonFiniteError` naming the step.

`check_finite_weights` is called before every checkpoint save: a checkpoint of non-finite weights
would be loaded by every resume.
"""

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as tt_dist_utils
from torchtitan.tools.logging import logger

_torchtitan_clip_grad_norm_ = tt_dist_utils.clip_grad_norm_


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers it will not train on or save."""


def _all_ranks(flags: torch.Tensor) -> torch.Tensor:
    """Elementwise AND of int32 flags over every rank."""
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return flags


class FiniteStepGuard:
    """Skips the optimizer step of a non-finite training step; stops after too many in a row.

    The trainer calls `begin(step)` before each step and `add_loss(loss)` per microbatch.
    """

    def __init__(self, optimizers: OptimizersContainer, max_consecutive: int) -> None:
        self.optimizers = optimizers
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0
        self.step = 0
        self.loss: torch.Tensor | float = 0.0
        self.grad_norm: torch.Tensor | None = None
        self._optimizer_step = optimizers.step
        optimizers.step = self.optimizer_step
        # Process-wide (train_step looks it up in torchtitan's module): the newest trainer's guard
        # takes it over, so trainers of one process (context stages) must run one at a time.
        tt_dist_utils.clip_grad_norm_ = self.clip_grad_norm_

    def begin(self, step: int) -> None:
        self.step, self.loss, self.grad_norm = step, 0.0, None

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss = self.loss + loss.detach()

    def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.grad_norm = _torchtitan_clip_grad_norm_(*args, **kwargs)
        return self.grad_norm

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        finite = torch.isfinite(torch.as_tensor(self.loss)) & torch.isfinite(self.grad_norm)
        if _all_ranks(finite.to(torch.int32)).item():
            self.consecutive = 0
            self._optimizer_step(*args, **kwargs)
            return
        self.skipped += 1
        self.consecutive += 1
        numbers = f"loss {float(self.loss):.4g} on this rank, grad norm {float(self.grad_norm):.4g}"
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"step {self.step}: {self.consecutive} steps in a row with a non-finite loss or "
                f"grad norm ({numbers}); stopping (training.max_consecutive_skipped_steps = "
                f"{self.max_consecutive})")
        logger.warning(f"step {self.step}: non-finite loss or grad norm ({numbers}); optimizer "
                       f"step skipped ({self.consecutive} in a row, {self.skipped} in all)")
        self.optimizers.zero_grad()
        balancing = getattr(self.optimizers, "load_balancing", None)
        if balancing is not None:
            balancing.discard()

    def stats(self) -> dict[str, float]:
        """Counters the trainer logs: steps skipped so far in this run."""
        return {"train/skipped_steps": self.skipped}


def check_finite_weights(model_parts: list[nn.Module], step: int) -> None:
    """Raise NonFiniteError unless every parameter and buffer is finite on every rank (all ranks
    raise together, so none is left waiting in the save's collectives); a rank names its own
    first non-finite tensor. One flag per rank is reduced: pipeline ranks hold different tensors."""
    named = [(name, t.to_local() if isinstance(t, DTensor) else t)
             for part in model_parts
             for name, t in itertools.chain(part.named_parameters(), part.named_buffers())]
    bad = [name for name, t in named if not torch.isfinite(t.detach()).all()]
    device = named[0][1].device  # nccl reduces device tensors only
    if _all_ranks(torch.tensor([int(not bad)], dtype=torch.int32, device=device)).item():
        return
    where = f"{bad[0]} (and {len(bad) - 1} more tensors)" if bad else "a tensor on another rank"
    raise NonFiniteError(
        f"refusing to save the checkpoint of step {step}: {where} holds non-finite values; the "
        "run diverged, resume from an earlier checkpoint with a lower optimizer.lr")
