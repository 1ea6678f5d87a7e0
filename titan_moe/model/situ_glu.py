"""SiTU-GLU: a bounded gated linear unit (spec §5).

    SiTU_β(g) = β · tanh(g / β) · σ(g)
    h = SiTU_β1(W1 z) ⊙ β2 · tanh(W3 z / β2)
    SiTUGLU(z) = W2 h

With β1 = 4, β2 = 25 every element of h lies in (-100, 100) whatever the input, which is what
keeps the experts stable; near 0, tanh(g/β)·β ≈ g, so the unit behaves like SwiGLU there.

Long context (`token_chunk` > 0, the dense layers' `seq_segment`): the block runs over chunks of
that many flattened tokens, each under its own activation checkpoint
(`token_chunks.checkpointed_chunks`), so backward holds one chunk's hidden activations.

The unit itself is titan_moe/ops/situ_glu (a Triton op for eager CUDA, the reference otherwise).
"""

import torch
from torch import nn

from titan_moe.model.token_chunks import checkpointed_chunks
from titan_moe.ops.situ_glu import situ, situ_glu, situ_glu_packed

__all__ = ["SiTUGLU", "situ", "situ_glu"]


class SiTUGLU(nn.Module):
    """A dense SiTU-GLU feed-forward block: w2(situ_glu(W1 x, W3 x)); with token_chunk > 0
    by checkpointed chunks of that many flattened tokens. W1 and W3 are one Linear, w13 =
    [W1; W3] (as the routed experts store them): one GEMM in, and x's gradient from one GEMM
    over [∂a | ∂b]."""

    def __init__(self, dim: int, hidden_dim: int, beta1: float = 4.0, beta2: float = 25.0,
                 token_chunk: int = 0):
        super().__init__()
        if token_chunk < 0:
            raise ValueError(f"token_chunk must be >= 0 (0: no chunks), got {token_chunk}")
        self.token_chunk = token_chunk
        self.beta1 = beta1
        self.beta2 = beta2
        self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]."""
        if not self.token_chunk:
            return self._tokens(x)
        y = checkpointed_chunks(self._tokens, self.token_chunk, x.reshape(-1, x.shape[-1]))
        return y.view(x.shape)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(situ_glu_packed(self.w13(x), self.beta1, self.beta2))

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        nn.init.trunc_normal_(self.w13.weight, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(
            self.w2.weight, std=out_init_std, a=-3 * out_init_std, b=3 * out_init_std
        )
