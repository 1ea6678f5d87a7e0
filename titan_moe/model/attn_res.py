"""Block Attention Residuals (spec §2): one learned softmax mix over the residual sources.

For sources V_1..V_n ([B, T, d]) at one site with pseudo-query w and gain γ (both [d], fp32):

    key_i   = V_i / sqrt(mean(V_i²) + eps)
    score_i = <key_i, γ ⊙ w>
    p       = softmax_i(score)
    out     = Σ_i p_i V_i            (the raw, un-normalised sources)

w starts at 0, so every site starts as the uniform mean of its sources. All of it runs in fp32
(or wider); the result is cast back to the sources' dtype.
"""

import torch
import torch.nn as nn


class AttnResSite(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim, dtype=torch.float32))
        self.gain = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(sources, self.query, self.gain, self.eps).to(sources[0].dtype)

    def init_weights(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.gain)


def attn_res_mix(
    sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float
) -> torch.Tensor:
    """The site's output in fp32 at least (float64 stays float64, for the reference tests), never
    in AMP's bf16; the site casts it back to the sources' dtype. Kept apart from that cast so
    that compile_passes/attn_res_fusion.py can match the mix alone: on CUDA Inductor folds the
    cast to bf16 and the next RMSNorm's cast back to fp32 away."""
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    with torch.autocast(sources[0].device.type, enabled=False):
        v = torch.stack(sources).to(dtype)
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        scores = keys @ (gain * query).to(dtype)
        p = torch.softmax(scores, dim=0)
        return (p.unsqueeze(-1) * v).sum(0)
