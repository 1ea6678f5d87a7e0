"""Sigmoid top-k router with the Quantile Balancing bias (spec §5, §6).

    s = σ(W_r x)                         fp32, on the full-width FFN input
    I = topk(s + b, k)                   b: QB bias, no gradient; ties go to the lower expert index
    p_e = ρ · s_e / Σ_{j∈I} s_j,  e ∈ I  combine weights from the unbiased scores

The top-(k+1) is taken so the QB cutoff alpha = (k+1)-th biased score comes for free; the
histogram of r = alpha - s is accumulated here (see quantile_balance.py) on training forwards
that are not activation-checkpoint recomputes.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_moe.model.quantile_balance import qb_histogram


def topk_lowest_index_on_ties(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim, ties broken towards the lower index.

    torch.topk promises no order among equal values; a stable descending sort keeps them in index
    order and changes nothing else. On an H200 sorting [16384, 896] fp32 rows took 0.53 ms against
    0.50 ms for topk(17) (CPU sorts are slower, but CPU runs are debug-sized).
    """
    top_values, ids = values.sort(dim=-1, descending=True, stable=True)
    return top_values[..., :k], ids[..., :k]


def _in_backward() -> bool:
    # Activation checkpointing (torch.utils.checkpoint, reentrant or not) re-runs forward inside
    # the backward graph task; an ordinary forward runs outside any graph task.
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("titan_moe::add_qb_stats", mutates_args=("hist", "load"))
def add_qb_stats(
    hist: torch.Tensor, hist_delta: torch.Tensor, load: torch.Tensor, load_delta: torch.Tensor
) -> None:
    """hist += hist_delta; load += load_delta, unless this forward is a checkpoint recompute.

    An opaque op so the check runs when the forward runs, not when it is traced: an eager
    checkpoint around a compiled module re-runs the compiled forward inside backward, and a
    trace-time check would have been folded away.
    """
    if not _in_backward():
        hist.add_(hist_delta)
        load.add_(load_delta)


@add_qb_stats.register_fake
def _(hist: torch.Tensor, hist_delta: torch.Tensor, load: torch.Tensor, load_delta: torch.Tensor):
    return None


class Router(nn.Module):
    """Routes each token to k of E experts; accumulates the QB histogram and expert load."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        route_scale: float = 1.0,
        n_bins: int = 1000,
        layer_id: int = 0,
    ):
        super().__init__()
        if not 0 < top_k < n_experts:
            raise ValueError(f"need 0 < top_k < n_experts, got top_k={top_k}, E={n_experts}")
        self.n_experts = n_experts
        self.top_k = top_k
        self.route_scale = route_scale
        self.n_bins = n_bins
        self.layer_id = layer_id
        self.keep_scores = False
        self.kept_scores: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        # int32 counts are exact to 2^31 per bin per step; fp32 would stop being exact at 2^24,
        # which a single bin can reach once a step's tokens are summed over data-parallel ranks.
        self.register_buffer(
            "qb_hist", torch.zeros(n_experts, n_bins, dtype=torch.int32), persistent=False
        )
        self.register_buffer(
            "expert_load", torch.zeros(n_experts, dtype=torch.int32), persistent=False
        )

    def forward(
        self, x: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim], valid [N] bool -> (expert ids [N, k] int64, combine weights [N, k]).

        Scores and weights are fp32 (float64 for float64 x, as in the exactness tests).
        """
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.to(compute_dtype), self.weight.to(compute_dtype)))
        biased = scores.detach() + self.expert_bias
        top_values, top_ids = topk_lowest_index_on_ties(biased, self.top_k + 1)
        expert_ids = top_ids[:, : self.top_k]
        chosen = scores.gather(-1, expert_ids)
        weights = chosen / chosen.sum(-1, keepdim=True) * self.route_scale
        if self.training:
            self._accumulate(scores.detach(), top_values[:, self.top_k], expert_ids, valid)
        return expert_ids, weights

    @torch.no_grad()
    def _accumulate(
        self,
        scores: torch.Tensor,
        cutoff: torch.Tensor,
        expert_ids: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> None:
        hist = qb_histogram(scores, cutoff, self.expert_bias, self.n_bins, valid)
        if valid is None:
            counts = torch.ones_like(expert_ids, dtype=torch.int32)
        else:
            counts = valid.to(torch.int32).unsqueeze(-1).expand_as(expert_ids)
        load = torch.zeros_like(self.expert_load).scatter_add_(
            0, expert_ids.reshape(-1), counts.reshape(-1)
        )
        add_qb_stats(self.qb_hist, hist, self.expert_load, load)
        # Exact QB mode (tests) is eager-only: the kept scores are a Python list.
        if self.keep_scores and not _in_backward():
            valid = torch.ones_like(cutoff, dtype=torch.bool) if valid is None else valid
            self.kept_scores.append((scores.clone(), valid.clone()))

    def reset_qb_stats(self) -> None:
        """Zero the histogram and load counts and drop kept scores (after a QB step)."""
        self.qb_hist.zero_()
        self.expert_load.zero_()
        self.kept_scores.clear()

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.weight, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.expert_bias.zero_()
        self.reset_qb_stats()
