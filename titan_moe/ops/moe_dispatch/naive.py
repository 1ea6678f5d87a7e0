"""The MoE layer's dispatch and combine in plain PyTorch: the reference of the Triton ops.

The router gives each token t its k experts; pair p = t·k + j is token t's j-th choice, and
dest[p] is the row of the expert-grouped buffer that pair p takes (`model/moe.py`'s
dispatch_layout: rows grouped by expert, each group padded with rows no pair takes).

    dispatch   grouped[dest[p]] = z[p // k],   grouped[r] = 0 on every row no pair takes
    combine    u[t] = Σ_j w[t, j] · expert_out[dest[t·k + j]]   (in w's precision)

Their gradients:

    dispatch   dz[t] = Σ_j dgrouped[dest[t·k + j]]
    combine    dexpert_out[dest[p]] = w[p] · du[p // k],  0 on every row no pair takes
               dw[p] = <expert_out[dest[p]], du[p // k]>

Every pair has its own row, so both scatters are plain copies (no accumulation), and the rows no
pair takes (group padding, the buffer's tail) are zero both ways: the grouped GEMMs' weight
gradients read the padding rows, and whatever the experts left in them is never read.
"""

import torch
from torch import Tensor

from titan_moe.ops.gather_rows import gather_distinct_rows


def moe_dispatch_naive(z: Tensor, dest: Tensor, n_rows: int, top_k: int) -> Tensor:
    """z [N, d], dest [N·k] int64 distinct rows -> grouped [n_rows, d] in z's dtype."""
    pairs = z.unsqueeze(1).expand(z.shape[0], top_k, z.shape[1]).reshape(-1, z.shape[1])
    return z.new_zeros(n_rows, z.shape[1]).index_copy(0, dest, pairs)


def moe_combine_naive(expert_out: Tensor, dest: Tensor, weights: Tensor) -> Tensor:
    """expert_out [R, d], dest [N·k] int64 distinct rows, weights [N, k] -> u [N, d] in the
    promoted dtype of expert_out and weights (fp32 for bf16 rows and fp32 weights)."""
    n_tokens, top_k = weights.shape
    pair_out = gather_distinct_rows(expert_out, dest).view(n_tokens, top_k, -1)
    dtype = torch.promote_types(expert_out.dtype, weights.dtype)
    return (pair_out.to(dtype) * weights.unsqueeze(-1).to(dtype)).sum(1)
