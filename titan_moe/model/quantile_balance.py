"""Quantile Balancing (QB): the auxiliary-loss-free expert bias of spec §6.

b is the dual variable of the balanced assignment LP (each token picks k of E experts, each expert
gets q = T·k/E tokens). Per micro-batch, with s the sigmoid scores and b the current bias:

    alpha_t = (k+1)-th largest of (s_t + b)        the token's selection cutoff
    r[t, e] = alpha_t - s[t, e]                     the bias expert e needs to enter token t's top-k
    hist[e, bin(r[t, e])] += 1                      n_bins equal bins over [min(b) - 1, max(b) + 1]

Expert e is chosen by token t when s[t, e] + b_e > alpha_t, i.e. when r[t, e] < b_e. So once per
optimizer step each expert takes the bias below which q of the step's T tokens fall:

    b_e = (q+1)-th smallest of r[:, e] = -((q+1)-th largest of (s[:, e] - alpha)),
          q = floor(T·k/E)
    b  <- b - mean(b)         top-k is shift invariant; centring keeps b bounded

The histogram form interpolates linearly inside the bin where the cumulative count reaches T·k/E,
which lands in the same bin as the exact order statistic, so the two agree within one bin width.
"""

import torch
import torch.distributed as dist
from torch import nn


def qb_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The histogram range [min(b) - 1, max(b) + 1] as 0-d fp32 tensors (no host sync).

    alpha is some s_j + b_j with s in (0, 1), so r = alpha - s lies strictly inside this range.
    """
    bias = bias.float()
    return bias.min() - 1.0, bias.max() + 1.0


def qb_histogram(
    scores: torch.Tensor,
    cutoff: torch.Tensor,
    bias: torch.Tensor,
    n_bins: int = 1000,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert histogram of r = cutoff[:, None] - scores, shape [E, n_bins], int32.

    scores [T, E] are the unbiased sigmoid scores, cutoff [T] the (k+1)-th largest biased score
    per token, bias [E] the bias the cutoffs were computed with (it fixes the range, see qb_range).
    valid [T] bool marks real tokens; padding contributes zero counts. Values outside the range
    (only possible through rounding) are clamped into the first or last bin. Compile-friendly: one
    scatter_add_ into a flat [E * n_bins] buffer.
    """
    n_tokens, n_experts = scores.shape
    lo, hi = qb_range(bias)
    r = cutoff.float().unsqueeze(-1) - scores.float()
    # NaN scores (a diverged step, which the trainer then skips) go to bin 0 as in the Triton
    # kernel, instead of becoming an out-of-range index.
    bins = ((r - lo) * (n_bins / (hi - lo))).floor().nan_to_num(0.0).clamp(0, n_bins - 1)
    bins = bins.to(torch.int64)
    flat = bins + torch.arange(n_experts, device=scores.device).mul(n_bins)
    if valid is None:
        counts = torch.ones_like(flat, dtype=torch.int32)
    else:
        counts = valid.to(torch.int32).unsqueeze(-1).expand(n_tokens, n_experts)
    hist = torch.zeros(n_experts * n_bins, dtype=torch.int32, device=scores.device)
    hist.scatter_add_(0, flat.reshape(-1), counts.reshape(-1))
    return hist.view(n_experts, n_bins)


def _centre(bias: torch.Tensor) -> torch.Tensor:
    return bias - bias.mean()


def qb_bias_from_histogram(
    hist: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    top_k: int,
    centre: bool = True,
) -> torch.Tensor:
    """New bias [E] (fp32) from a histogram over [lo, hi] of r, one row per expert.

    With T = tokens counted (every row sums to T) and the target q = T·k/E, b_e is the point where
    the histogram's cumulative count, linearly interpolated inside each bin, reaches q: about q
    tokens have r[t, e] < b_e. It lies in the bin holding the (floor(q)+1)-th smallest r[:, e], so
    it is within one bin width (hi - lo) / n_bins of qb_bias_exact. Mean-centred unless
    centre=False. An empty histogram gives every expert the same value (QuantileBalancer keeps
    the old bias instead).
    """
    n_experts, n_bins = hist.shape
    counts = hist.double()
    cum_end = counts.cumsum(-1)
    target = cum_end[:, -1:] * (top_k / n_experts)
    # The first bin whose cumulative end exceeds the target holds the quantile.
    j = (cum_end <= target).sum(-1, keepdim=True).clamp(max=n_bins - 1)
    in_bin = counts.gather(-1, j)
    below = cum_end.gather(-1, j) - in_bin
    frac = ((target - below) / in_bin.clamp(min=1.0)).clamp(0.0, 1.0)
    width = (hi.double() - lo.double()) / n_bins
    bias = (lo.double() + (j + frac) * width).squeeze(-1).float()
    return _centre(bias) if centre else bias


def qb_bias_exact(
    scores: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    valid: torch.Tensor | None = None,
    centre: bool = True,
) -> torch.Tensor:
    """Exact QB bias [E]: b_e = (q+1)-th smallest of r[:, e], q = floor(T·k/E), T valid tokens.

    The reference for tests: it sorts all scores and reads T on the host, so it is neither cheap
    nor compile-friendly, and it sees only this process's tokens. Computed in float64; returned
    in float64 for float64 scores, else fp32.
    """
    n_tokens, n_experts = scores.shape
    out_dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.double()
    cutoff = (scores + bias.double()).topk(top_k + 1, dim=-1).values[:, top_k]
    r = cutoff.unsqueeze(-1) - scores
    if valid is not None:
        r = r.masked_fill(~valid.unsqueeze(-1), float("inf"))
        n_tokens = int(valid.sum())
    q = n_tokens * top_k // n_experts
    new_bias = r.kthvalue(q + 1, dim=0).values.to(out_dtype)
    return _centre(new_bias) if centre else new_bias


class QuantileBalancer:
    """Once-per-optimizer-step QB update of every Router in a model.

    step() all-reduces all routers' histograms and load counts in one collective over dp_group
    (ranks holding distinct tokens, not tensor-parallel replicas), sets each router's expert_bias
    to the new centred bias, clears the accumulators and returns routing-health metrics. With
    exact=True the bias comes from the raw scores the routers kept instead (tests only; local
    tokens only).
    """

    def __init__(
        self, model: nn.Module, dp_group: dist.ProcessGroup | None = None, exact: bool = False
    ):
        # router.py imports this module's histogram, so Router is imported here, not at the top.
        from titan_moe.model.router import Router

        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.dp_group = dp_group
        self.exact = exact
        for router in self.routers:
            router.keep_scores = exact
        # [n_routers, E] float64 expert loads (token-slot counts) of the last step, all-reduced,
        # rows in self.routers order: what the trainer logs as the expert-load histogram.
        self.expert_load: torch.Tensor | None = None

    @property
    def layer_ids(self) -> list[int]:
        return [router.layer_id for router in self.routers]

    def _all_reduce(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = [torch.cat([r.qb_hist.flatten(), r.expert_load]) for r in self.routers]
        flat = torch.cat(parts)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        out = []
        for router, part in zip(self.routers, flat.split([p.numel() for p in parts]), strict=True):
            n_experts = router.expert_load.numel()
            out.append((part[:-n_experts].view_as(router.qb_hist), part[-n_experts:]))
        return out

    def _new_bias(self, router: nn.Module, hist: torch.Tensor) -> torch.Tensor:
        if self.exact and router.kept_scores:
            scores = torch.cat([s for s, _ in router.kept_scores])
            valid = torch.cat([v for _, v in router.kept_scores])
            return qb_bias_exact(scores, router.expert_bias, router.top_k, valid)
        lo, hi = qb_range(router.expert_bias)
        return qb_bias_from_histogram(hist, lo, hi, router.top_k)

    def discard(self) -> None:
        """Clear the accumulators without updating any bias (a skipped, non-finite step)."""
        for router in self.routers:
            router.reset_qb_stats()

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Update every router's bias; return the step's routing-health metrics.

        moe/max_violation is the mean over layers of max_load / mean_load - 1 for the loads routed
        since the last step; moe/layer{i}/max_violation and moe/layer{i}/bias_spread (max - min
        of the new bias) are per router, i its layer_id. One host sync, for the metrics.
        """
        if not self.routers:
            return {}
        violations, spreads, loads = [], [], []
        for router, (hist, load) in zip(self.routers, self._all_reduce(), strict=True):
            seen = hist[0].sum() > 0
            new_bias = torch.where(seen, self._new_bias(router, hist), router.expert_bias)
            router.expert_bias.copy_(new_bias)
            load = load.double()
            violation = load.max() / load.mean().clamp(min=1e-12) - 1.0
            violations.append(torch.where(load.sum() > 0, violation, 0.0))
            spreads.append(new_bias.max() - new_bias.min())
            loads.append(load)
            router.reset_qb_stats()
        self.expert_load = torch.stack(loads)
        violation = torch.stack(violations)
        values = torch.cat([violation.mean().view(1), violation, torch.stack(spreads).double()])
        values = values.tolist()
        n = len(self.routers)
        metrics = {"moe/max_violation": values[0]}
        for i, layer_id in enumerate(self.layer_ids):
            metrics[f"moe/layer{layer_id}/max_violation"] = values[1 + i]
            metrics[f"moe/layer{layer_id}/bias_spread"] = values[1 + n + i]
        return metrics
