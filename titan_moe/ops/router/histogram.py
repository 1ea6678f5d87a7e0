"""The Quantile Balancing histogram of r = alpha - s (spec §6) and its range.

    alpha_t = (k+1)-th largest of (s_t + b)        the token's selection cutoff
    r[t, e] = alpha_t - s[t, e]                     the bias expert e needs to enter token t's top-k
    hist[e, bin(r[t, e])] += 1                      n_bins equal bins over [min(b) - 1, max(b) + 1]

The routing ops count it as they route; the balancer (`titan_moe.model.quantile_balance`) reads
each expert's new bias off it once per optimizer step.
"""

import torch


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
    # n_bins / (hi - lo) as one IEEE division, as the kernels compute it: `int / tensor` is
    # Tensor.__rtruediv__, a reciprocal then a product, off by an ulp for a quarter of biases.
    scale = torch.full_like(hi, n_bins) / (hi - lo)
    bins = ((r - lo) * scale).floor().nan_to_num(0.0).clamp(0, n_bins - 1)
    bins = bins.to(torch.int64)
    flat = bins + torch.arange(n_experts, device=scores.device).mul(n_bins)
    if valid is None:
        counts = torch.ones_like(flat, dtype=torch.int32)
    else:
        counts = valid.to(torch.int32).unsqueeze(-1).expand(n_tokens, n_experts)
    hist = torch.zeros(n_experts * n_bins, dtype=torch.int32, device=scores.device)
    hist.scatter_add_(0, flat.reshape(-1), counts.reshape(-1))
    return hist.view(n_experts, n_bins)
