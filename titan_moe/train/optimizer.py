"""The optimizer: torchtitan's AdamW with no weight decay on 1-D parameters, followed each step by
Quantile Balancing (spec §6).

1-D parameters are the norms' gains, the KDA decay parameters A_log and dt_bias, and the AttnRes
pseudo-queries and gains; the spec excludes the last four from weight decay, and decaying a norm
gain towards 0 has no use either.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.model.router import Router


def all_reduce_qb_stats(
    routers: Sequence[Router], group: dist.ProcessGroup | None = None
) -> None:
    """Sum the routers' QB histograms and expert loads over `group`, in place, in one collective.

    `group` is the ranks holding distinct tokens (not tensor-parallel replicas); None is the
    default group. Nothing to do without routers or an initialised process group.
    """
    if not routers or not (dist.is_available() and dist.is_initialized()):
        return
    parts = [torch.cat([r.qb_hist.flatten(), r.expert_load]) for r in routers]
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for router, part in zip(routers, flat.split([p.numel() for p in parts]), strict=True):
        n_experts = router.expert_load.numel()
        router.qb_hist.copy_(part[:-n_experts].view_as(router.qb_hist))
        router.expert_load.copy_(part[-n_experts:])


class LoadBalancing:
    """Optimizer post-step hook: sum every balancer's statistics over `dp_group` (None: this
    rank's tokens are the whole batch, nothing to sum), then run it once. The metrics they keep
    are read on demand (`metrics`), so a step makes no host read. `skip` is the step guard's
    device flag of the step (step_guard.py, fused path): where it is 1 the optimizer update was
    skipped, and the balancers keep their biases too.

    Under pipeline parallelism each rank balances the MoE layers of its own stages and
    `pp_group` gathers every stage's per-layer metrics, so the logging rank (torchtitan's: the
    last stage's) reports all layers and `moe/max_violation` is their mean over the whole model.
    """

    def __init__(
        self,
        balancers: Sequence[Any],
        dp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.balancers = list(balancers)
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.skip: torch.Tensor | None = None

    def __call__(self, *_args: Any, **_kwargs: Any) -> None:
        for balancer in self.balancers:
            if self.dp_group is not None:
                all_reduce_qb_stats(balancer.routers, self.dp_group)
            balancer.step(self.skip)

    @property
    def metrics(self) -> dict[str, float]:
        """The last step's routing-health metrics of every balancer, read from the device. Under
        pipeline parallelism a collective over `pp_group`: every rank reads them at the same
        step (torchtitan logs on every rank at each logging step)."""
        metrics: dict[str, float] = {}
        for balancer in self.balancers:
            metrics.update(balancer.metrics())
        if self.pp_group is not None:
            stages: list[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, metrics, group=self.pp_group)
            metrics = {k: v for stage in stages for k, v in stage.items()}
        return with_model_max_violation(metrics)

    def discard(self) -> None:
        """Drop the statistics of a step whose optimizer step was skipped (step_guard.py)."""
        for balancer in self.balancers:
            balancer.discard()


def with_model_max_violation(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` with moe/max_violation the mean of every moe/layer<i>/max_violation in it (one
    balancer's mean covers its own model part only)."""
    layers = [v for k, v in metrics.items()
              if k.startswith("moe/layer") and k.endswith("/max_violation")]
    if not layers:
        return metrics
    return {**metrics, "moe/max_violation": sum(layers) / len(layers)}


def attach_load_balancing(
    optimizers: OptimizersContainer,
    balancers: Sequence[Any],
    dp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Register the balancers' step after each optimizer step; expose them to the metrics."""
    hook = LoadBalancing(balancers, dp_group, pp_group)
    optimizers.register_step_post_hook(hook)
    optimizers.load_balancing = hook


def build_optimizers_with_quantile_balancing(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: Any = None,
) -> OptimizersContainer:
    """torchtitan's optimizers, followed each step by a QuantileBalancer per model part (a
    pipeline rank's parts are its stages)."""
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    exclude_1d_from_weight_decay(optimizers)
    # QB histograms are summed over the ranks that hold distinct tokens of the same layers: data
    # and context parallel ranks (torchtitan's "loss" mesh), never tensor-parallel replicas nor
    # other pipeline stages (their layers differ).
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    pp_mesh = parallel_dims.get_optional_mesh("pp")
    attach_load_balancing(optimizers, [QuantileBalancer(m) for m in model_parts],
                          loss_mesh.get_group() if loss_mesh is not None else None,
                          pp_mesh.get_group() if pp_mesh is not None else None)
    return optimizers


def exclude_1d_from_weight_decay(optimizers: OptimizersContainer) -> None:
    """Split each optimizer's single group into (≥2-D: decayed, 1-D: weight_decay = 0).

    Done before the first step, so there is no optimizer state to move.
    """
    for optimizer in optimizers:
        (group,) = optimizer.param_groups
        decay = [p for p in group["params"] if p.ndim >= 2]
        no_decay = [p for p in group["params"] if p.ndim < 2]
        optimizer.param_groups = [
            {**group, "params": decay},
            {**group, "params": no_decay, "weight_decay": 0.0},
        ]
