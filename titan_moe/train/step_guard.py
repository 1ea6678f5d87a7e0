"""Finite-or-stop training: no optimizer update and no checkpoint from non-finite numbers.

torchtitan 0.2.2's `train_step` runs forward/backward per microbatch, clips the gradients
(`clip_grad_norm_` returns the global norm: a DTensor norm is reduced with `full_tensor()`, so
every rank holds the same value), then calls `optimizers.step()` and `lr_schedulers.step()`.
`FiniteStepGuard` stands in for the clip and for `optimizers.step()`. A step whose loss or grad
norm is not finite on any rank (one all-reduced flag, so every rank takes the same decision) makes
no optimizer update and no Quantile Balancing bias update (the balancers run as the optimizer's
post-step hook). The LR schedule still advances: it follows the step count, and the skipped step's
batch is consumed. `max_consecutive` skipped steps in a row raise `NonFiniteError` naming the step.
The logged grad norm is the total norm before clipping, as torchtitan's.

Two paths, chosen by the optimizers' `fused` setting (`FiniteStepGuard.fused`):

- fused (torch's fused Adam/AdamW, our configs' default): no host read and no scale pass. The clip
  computes the total norm only (`total_grad_norm`); the optimizers get `grad_scale` =
  max(1, (norm + 1e-6) / max_norm), torch's clip coefficient inverted, which the fused kernel
  divides the gradients by, and `found_inf` = the step's non-finite flag, on which the kernel
  skips the update and undoes its step count (how GradScaler drives it). The balancers get the
  same flag and keep their biases. Both stay on the device, so the host goes on issuing work.
  The flag is copied to the host without a wait and counted one step late: in the next step's
  optimizer step, after that step's forward/backward and update are queued, so the host waits at
  most for an already finished step. Every log step and every checkpoint save count the steps
  still pending first, so `train/skipped_steps` is exact when logged and a run of non-finite
  steps stops before its checkpoint. The lag is safe: the device flag alone decides the skip, so
  a non-finite update is never applied, whenever the host learns of it; only the warning and
  `NonFiniteError` come one step later (the error still names the step that reached the limit),
  and checkpoints still call `check_finite_weights`.
- foreach / for-loop (these reject `grad_scale` and `found_inf`): torchtitan's clip, then one host
  read of the flag per step; a non-finite step skips the optimizer step, zeroes the gradients and
  discards the balancers' statistics.

`check_finite_weights` is called before every checkpoint save: a checkpoint of non-finite weights
would be loaded by every resume.
"""

import itertools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as tt_dist_utils
from torchtitan.tools.logging import logger

_torchtitan_clip_grad_norm_ = tt_dist_utils.clip_grad_norm_
# torch's clip_grads_with_norm_ scales by max_norm / (norm + _CLIP_EPS), at most 1.
_CLIP_EPS = 1e-6


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers it will not train on or save."""


def _all_ranks(flags: torch.Tensor) -> torch.Tensor:
    """Elementwise AND of int32 flags over every rank."""
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return flags


def _full(norm: torch.Tensor) -> torch.Tensor:
    # A DTensor norm is a partial over its mesh: reducing it gives every rank the total.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    ep_enabled: bool = False,
) -> torch.Tensor:
    """The total gradient norm torchtitan 0.2.2's `clip_grad_norm_` returns, without scaling the
    gradients. Under expert parallelism the expert gradients (DTensors on a mesh with an "ep"
    dimension) and the others live on different meshes: each group's norm is reduced on its own
    mesh, then the two are combined; under pipeline parallelism the stages' norms are combined
    over `pp_mesh`."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups = [grads]
    if ep_enabled:
        groups = [[g for g in grads if ("ep" in g.device_mesh.mesh_dim_names) == expert]
                  for expert in (True, False)]
    norms = [_full(torch.nn.utils.get_total_norm(group, norm_type, False, foreach))
             for group in groups if group] or [torch.zeros(())]
    total = norms[0]
    if len(norms) > 1:
        stacked = torch.stack(norms)
        total = (stacked.max() if math.isinf(norm_type)
                 else stacked.pow(norm_type).sum().pow(1.0 / norm_type))
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total = total.pow(1.0 / norm_type)
    return total


class _HostCopy:
    """A device tensor copied to the host without waiting: `tolist()` waits for that copy only
    (an event recorded after it), never for work queued later."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor.cpu()
            return
        # Into pinned memory (from torch's caching host allocator): only then is the copy async.
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class FiniteStepGuard:
    """Skips the optimizer update of a non-finite training step; stops after too many in a row.

    The trainer calls `begin(step)` before each step and `add_loss(loss)` per microbatch, and
    `settle()` before a checkpoint save and after the last step.
    """

    def __init__(self, optimizers: OptimizersContainer, max_consecutive: int) -> None:
        self.optimizers = optimizers
        self.max_consecutive = max_consecutive
        # The one place the path is chosen: only torch's fused kernels take grad_scale/found_inf.
        self.fused = all(optimizer.defaults.get("fused") for optimizer in optimizers)
        self.skipped = 0
        self.consecutive = 0
        self.step = 0
        self.loss: torch.Tensor | float = 0.0
        self.grad_norm: torch.Tensor | None = None
        self.max_norm = math.inf
        # (step, its outcome on the way to the host), fused path only, oldest first.
        self._pending: list[tuple[int, _HostCopy]] = []
        self._optimizer_step = optimizers.step
        optimizers.step = self.optimizer_step
        # Process-wide (train_step looks it up in torchtitan's module): the newest trainer's guard
        # takes it over, so trainers of one process (context stages) must run one at a time.
        tt_dist_utils.clip_grad_norm_ = self.clip_grad_norm_

    def begin(self, step: int) -> None:
        self.step, self.loss, self.grad_norm = step, 0.0, None

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss = self.loss + loss.detach()

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        foreach: bool | None = None,
        pp_mesh: DeviceMesh | None = None,
        ep_enabled: bool = False,
    ) -> torch.Tensor:
        """torchtitan's `clip_grad_norm_`; on the fused path the norm only, the fused optimizer
        step applies the clip."""
        if self.fused:
            self.max_norm = max_norm
            self.grad_norm = total_grad_norm(parameters, norm_type, foreach, pp_mesh, ep_enabled)
        else:
            self.grad_norm = _torchtitan_clip_grad_norm_(
                parameters, max_norm, norm_type, foreach=foreach, pp_mesh=pp_mesh,
                ep_enabled=ep_enabled)
        return self.grad_norm

    def _outcome(self) -> torch.Tensor:
        """[1 if the loss and grad norm are finite on every rank else 0, this rank's loss, the
        grad norm], float32 on the device."""
        norm = self.grad_norm.float()
        loss = torch.as_tensor(self.loss, device=norm.device).float()
        finite = _all_ranks((loss.isfinite() & norm.isfinite()).to(torch.int32))
        return torch.stack([finite.float(), loss, norm])

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        outcome = self._outcome()
        balancing = getattr(self.optimizers, "load_balancing", None)
        if not self.fused:
            finite, loss, norm = outcome.tolist()  # the step's one host read
            self._count(self.step, bool(finite), loss, norm)
            if finite:
                self._optimizer_step(*args, **kwargs)
                return
            self.optimizers.zero_grad()
            if balancing is not None:
                balancing.discard()
            return
        found_inf = 1.0 - outcome[0]
        grad_scale = ((outcome[2] + _CLIP_EPS) / self.max_norm).clamp(min=1.0)
        for optimizer in self.optimizers:
            optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
        if balancing is not None:
            balancing.skip = found_inf
        self._optimizer_step(*args, **kwargs)
        self._pending.append((self.step, _HostCopy(outcome)))
        self._settle(keep=1)

    def settle(self) -> None:
        """Count every step still pending (fused path): waits for the last optimizer step."""
        self._settle(keep=0)

    def _settle(self, keep: int) -> None:
        while len(self._pending) > keep:
            step, outcome = self._pending.pop(0)
            finite, loss, norm = outcome.tolist()
            self._count(step, bool(finite), loss, norm)

    def _count(self, step: int, finite: bool, loss: float, norm: float) -> None:
        if finite:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        numbers = f"loss {loss:.4g} on this rank, grad norm {norm:.4g}"
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"step {step}: {self.consecutive} steps in a row with a non-finite loss or "
                f"grad norm ({numbers}); stopping (training.max_consecutive_skipped_steps = "
                f"{self.max_consecutive})")
        logger.warning(f"step {step}: non-finite loss or grad norm ({numbers}); optimizer "
                       f"step skipped ({self.consecutive} in a row, {self.skipped} in all)")

    def stats(self) -> dict[str, float]:
        """Counters the trainer logs: steps skipped so far in this run (pending steps counted)."""
        self.settle()
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
