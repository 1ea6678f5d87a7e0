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

The histogram (`titan_moe.ops.router.histogram`) is counted by the routing ops as they route.
The histogram form interpolates linearly inside the bin where the cumulative count reaches T·k/E,
which lands in the same bin as the exact order statistic, so the two agree within one bin width.
"""

import torch
from torch import nn

from titan_moe.model.router import Router
from titan_moe.ops.router.histogram import qb_range


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

    step() sets each router's expert_bias to the new centred bias from its histogram, clears the
    accumulators and returns routing-health metrics. It reads the routers' histograms and load
    counts as they are: under data parallelism the trainer sums them over the ranks first
    (`titan_moe.train.optimizer.all_reduce_qb_stats`). With exact=True the bias comes from the raw
    scores the routers kept instead (tests only; local tokens only).
    """

    def __init__(self, model: nn.Module, exact: bool = False):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.exact = exact
        for router in self.routers:
            router.keep_scores = exact
        # [n_routers, E] float64 expert loads (token-slot counts) of the last step, rows in
        # self.routers order: what the trainer logs as the expert-load histogram.
        self.expert_load: torch.Tensor | None = None
        # The last step's routing-health values, still on the device: [mean violation, each
        # router's violation, each router's bias spread] (float64), read by `metrics`.
        self.health: torch.Tensor | None = None

    @property
    def layer_ids(self) -> list[int]:
        return [router.layer_id for router in self.routers]

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
    def step(self, skip: torch.Tensor | None = None) -> None:
        """Update every router's bias from the statistics routed since the last step; where the
        device flag `skip` is nonzero (the step's optimizer update was skipped) every bias stays
        as it is; the statistics are cleared and the metrics describe the step's routing all the
        same.

        Nothing is read back to the host: a read here would make the host wait for the optimizer
        step before it loads the next batch, and the GPU would then sit idle while it does (the
        trainer reads `metrics` on its logging steps only).
        """
        if not self.routers:
            return
        violations, spreads, loads = [], [], []
        for router in self.routers:
            hist, load = router.qb_hist, router.expert_load
            update = hist[0].sum() > 0
            if skip is not None:
                update = update & (skip == 0)
            new_bias = torch.where(update, self._new_bias(router, hist), router.expert_bias)
            router.expert_bias.copy_(new_bias)
            load = load.double()
            violation = load.max() / load.mean().clamp(min=1e-12) - 1.0
            violations.append(torch.where(load.sum() > 0, violation, 0.0))
            spreads.append(new_bias.max() - new_bias.min())
            loads.append(load)
            router.reset_qb_stats()
        self.expert_load = torch.stack(loads)
        violation = torch.stack(violations)
        self.health = torch.cat([violation.mean().view(1), violation,
                                 torch.stack(spreads).double()])

    def metrics(self) -> dict[str, float]:
        """The last step's routing-health metrics (one host read; {} before the first step).

        moe/max_violation is the mean over layers of max_load / mean_load - 1 for the loads routed
        in that step; moe/layer{i}/max_violation and moe/layer{i}/bias_spread (max - min of the
        new bias) are per router, i its layer_id.
        """
        if self.health is None:
            return {}
        values = self.health.tolist()
        n = len(self.routers)
        metrics = {"moe/max_violation": values[0]}
        for i, layer_id in enumerate(self.layer_ids):
            metrics[f"moe/layer{layer_id}/max_violation"] = values[1 + i]
            metrics[f"moe/layer{layer_id}/bias_spread"] = values[1 + n + i]
        return metrics
