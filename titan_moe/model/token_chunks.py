"""A per-token function run by chunks of tokens, each under its own activation checkpoint.

Long context (LatentMoE's `token_chunk`, the dense FFN's `seq_segment`): the function acts on
every token alone, so its output over the concatenated chunks equals one call over all N
tokens, while backward, and a full-AC recompute around the caller, hold one chunk's
intermediates at a time instead of all N tokens'. Inside torch.compile each checkpoint is a HOP
the partitioner recomputes; the chunks are unrolled, with static shapes per N.
"""

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def checkpointed_chunks(
    fn: Callable[..., torch.Tensor], chunk: int, x: torch.Tensor, *rows: torch.Tensor | None
) -> torch.Tensor:
    """fn(x, *rows) over chunks of `chunk` rows of x [N, ...] and of each of `rows` ([N, ...]
    or None: passed as None), concatenated; one call when 0 < chunk < N does not hold.

    fn must draw no random numbers: no RNG state is saved for the recompute.
    """
    if not 0 < chunk < x.shape[0]:
        return fn(x, *rows)
    # split, not slicing: its backward concatenates the chunks' input gradients once, where
    # each slice's would be a zero-filled [N, ...] tensor.
    xs = x.split(chunk)
    others = [[None] * len(xs) if r is None else r.split(chunk) for r in rows]
    return torch.cat([checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
                      for args in zip(xs, *others, strict=True)])
