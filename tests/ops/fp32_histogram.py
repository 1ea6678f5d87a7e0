"""The QB histogram in NumPy's fp32 arithmetic, one IEEE operation at a time: the range
[min(b) - 1, max(b) + 1], one division for n_bins / (hi - lo), then r = cutoff - s, (r - lo) x
scale, floor and clamp, as the kernels compute each (token, expert) bin. An independent reference
for `histogram.qb_histogram` and `bin_counts.count_bins_reference`."""

import numpy as np


def fp32_histogram(scores: np.ndarray, cutoff: np.ndarray, bias: np.ndarray, n_bins: int,
                   counted: np.ndarray | None = None) -> np.ndarray:
    """scores [T, E], cutoff [T], bias [E] fp32, counted [T] bool (None: every token) ->
    hist [E, n_bins] int32."""
    f32 = np.float32
    lo, hi = f32(bias.min()) - f32(1), f32(bias.max()) + f32(1)
    scale = f32(n_bins) / (hi - lo)
    if counted is not None:
        scores, cutoff = scores[counted], cutoff[counted]
    bins = np.clip(np.floor(((cutoff[:, None] - scores) - lo) * scale), 0, n_bins - 1)
    hist = np.zeros((scores.shape[1], n_bins), dtype=np.int32)
    np.add.at(hist, (np.broadcast_to(np.arange(scores.shape[1]), bins.shape),
                     bins.astype(np.int64)), 1)
    return hist
