"""Sigmoid top-k routing with the Quantile Balancing histogram, in plain PyTorch (spec §5, §6).

    s = σ(logits)                          fp32 (float64 for float64 logits)
    vals, ids = topk(s + b, k + 1)         ties to the lower expert index
    route = ids[:, :k]
    p = ρ · s[route] / Σ_{j∈route} s_j      unbiased scores, renormalised over the k routed
    alpha = vals[:, k]                     the token's QB cutoff
    hist[e, bin(alpha - s[:, e])] += 1     histogram.qb_histogram, valid tokens only
    load[e] += #(valid tokens routed to e)

The reference for the Triton op (`qb_route_triton.py`) and the path CPU tensors take. The sum
Σ s_j runs left to right over the routed slots, as the kernel sums them, so the two produce the
same bits for the same scores.
"""

import torch

from titan_moe.ops.router.histogram import qb_histogram


def topk_lowest_index_on_ties(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim, ties broken towards the lower index.

    torch.topk promises no order among equal values; a stable descending sort keeps them in index
    order and changes nothing else.
    """
    top_values, ids = values.sort(dim=-1, descending=True, stable=True)
    return top_values[..., :k], ids[..., :k]


def routed_load(
    expert_ids: torch.Tensor, n_experts: int, valid: torch.Tensor | None
) -> torch.Tensor:
    """[E] int32: how many (valid token, slot) pairs each expert was given."""
    if valid is None:
        counts = torch.ones_like(expert_ids, dtype=torch.int32)
    else:
        counts = valid.to(torch.int32).unsqueeze(-1).expand_as(expert_ids)
    load = torch.zeros(n_experts, dtype=torch.int32, device=expert_ids.device)
    return load.scatter_add_(0, expert_ids.reshape(-1), counts.reshape(-1))


def qb_route_naive(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float = 1.0,
    n_bins: int = 1000,
    valid: torch.Tensor | None = None,
    with_histogram: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E], bias [E], valid [T] bool -> (ids, weights, hist, load).

    ids [T, k] int64, weights [T, k] (fp32, float64 for float64 logits; differentiable w.r.t.
    logits), hist [E, n_bins] int32 and load [E] int32, both with 0 rows when with_histogram is
    False (eval forwards keep no statistics).
    """
    n_experts = logits.shape[-1]
    scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    top_values, top_ids = topk_lowest_index_on_ties(
        scores.detach() + bias.to(scores.dtype), top_k + 1
    )
    ids = top_ids[:, :top_k]
    chosen = scores.gather(-1, ids)
    total = chosen[:, 0]
    for j in range(1, top_k):
        total = total + chosen[:, j]
    weights = chosen / total.unsqueeze(-1) * route_scale
    if not with_histogram:
        empty = torch.zeros(0, dtype=torch.int32, device=logits.device)
        return ids, weights, empty.view(0, n_bins), empty
    with torch.no_grad():
        hist = qb_histogram(scores.detach(), top_values[:, top_k], bias, n_bins, valid)
        load = routed_load(ids, n_experts, valid)
    return ids, weights, hist, load
