"""Sigmoid top-k router with the Quantile Balancing bias (spec §5, §6).

    s = σ(W_r x)                         fp32-accurate, on the full-width FFN input
    I = topk(s + b, k)                   b: QB bias, no gradient; ties go to the lower expert index
    p_e = ρ · s_e / Σ_{j∈I} s_j,  e ∈ I  combine weights from the unbiased scores

The router GEMM runs here. Its weight is fp32 (an fp32 FSDP unit); bf16 activations, as mixed
precision gives them, go through `split_bf16_linear` (gemm "split_bf16", the default): two bf16
GEMMs against the weight's high and low bf16 parts, fp32-accurate on tensor cores. Otherwise
(gemm "fp32", fp32 or float64 activations) the activations are widened for one GEMM in the
weight's precision. Everything after the logits (σ, the top-(k+1), the weights, the QB
histogram of r = alpha - s and the expert load) is `titan_moe.ops.router.qb_route`, one Triton
pass on CUDA. The statistics are added to this router's buffers on training forwards that are
not activation-checkpoint recomputes.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_moe.ops.router import qb_route
from titan_moe.ops.split_bf16_linear import split_bf16_linear

ROUTER_GEMMS = ("split_bf16", "fp32")


def _in_backward() -> bool:
    # Activation checkpointing (torch.utils.checkpoint, reentrant or not) re-runs forward inside
    # the backward graph task; an ordinary forward runs outside any graph task.
    return torch._C._current_graph_task_id() != -1


def _add_qb_stats(
    hist: torch.Tensor, hist_delta: torch.Tensor, load: torch.Tensor, load_delta: torch.Tensor
) -> None:
    if not _in_backward():
        hist.add_(hist_delta)
        load.add_(load_delta)


# hist += hist_delta; load += load_delta, unless this forward is a checkpoint recompute. An opaque
# op so the check runs when the forward runs, not when it is traced: an eager checkpoint around a
# compiled module re-runs the compiled forward inside backward, and a trace-time check would have
# been folded away. Defined through torch.library.Library rather than custom_op: the compiled
# layer calls it on every forward, and custom_op's Python dispatch wrappers cost 27 us a call
# against 10.5 (CPU host, 2026-12-06), host time that a step not CUDA-graphed pays per MoE layer.
_LIB = torch.library.Library("titan_moe", "FRAGMENT")
_LIB.define(
    "add_qb_stats(Tensor(a!) hist, Tensor hist_delta, Tensor(b!) load, Tensor load_delta) -> ()"
)
_LIB.impl("add_qb_stats", _add_qb_stats, "CompositeExplicitAutograd")
torch.library.register_fake("titan_moe::add_qb_stats", lambda hist, hd, load, ld: None, lib=_LIB)
add_qb_stats = torch.ops.titan_moe.add_qb_stats.default


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
        gemm: str = "split_bf16",
    ):
        super().__init__()
        if not 0 < top_k < n_experts:
            raise ValueError(f"need 0 < top_k < n_experts, got top_k={top_k}, E={n_experts}")
        if gemm not in ROUTER_GEMMS:
            raise ValueError(f"gemm must be one of {ROUTER_GEMMS}, got {gemm!r}")
        self.gemm = gemm
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

        Logits and weights are fp32 (float64 for float64 x, as in the exactness tests).
        """
        with torch.autocast(x.device.type, enabled=False):
            if self.gemm == "split_bf16" and x.dtype == torch.bfloat16:
                logits = split_bf16_linear(x, self.weight.float())
            else:
                compute_dtype = torch.promote_types(x.dtype, torch.float32)
                logits = F.linear(x.to(compute_dtype), self.weight.to(compute_dtype))
        expert_ids, weights, hist, load = qb_route(
            logits, self.expert_bias, self.top_k, self.route_scale, self.n_bins, valid,
            with_histogram=self.training,
        )  # fmt: skip
        if self.training:
            add_qb_stats(self.qb_hist, hist, self.expert_load, load)
            # Exact QB mode (tests) is eager-only: the kept scores are a Python list.
            if self.keep_scores and not _in_backward():
                valid = torch.ones_like(logits[:, 0], dtype=torch.bool) if valid is None else valid
                self.kept_scores.append((torch.sigmoid(logits.detach()), valid.clone()))
        return expert_ids, weights

    def reset_qb_stats(self) -> None:
        """Zero the histogram and load counts and drop kept scores (after a QB step)."""
        self.qb_hist.zero_()
        self.expert_load.zero_()
        self.kept_scores.clear()

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.weight, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.expert_bias.zero_()
        self.reset_qb_stats()
