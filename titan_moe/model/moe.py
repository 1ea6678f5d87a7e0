"""Stable LatentMoE (spec §5): routed SiTU-GLU experts in a latent width plus shared experts.

    (I, p) = Router(x)                         sigmoid top-k with the QB bias, on full-width x
    z = W_down x                               latent width ℓ; dispatching z halves the bytes
    u = Σ_{e∈I} p_e · W2_e situ_glu(W1_e z, W3_e z)
    y = W_up RMSNorm_ℓ(u) + SiTUGLU_shared(x)

Dropless: the N·k (token, slot) pairs are sorted by expert (stable) and copied into expert
groups, each padded with zero rows to a multiple of `group_align` (the grouped GEMM's alignment:
8 rows for bf16, 16 for float8). Every group may need up to align - 1 padding rows, so the
buffer has the static size round_up(N·k + E·(align - 1), align) and rows past the last group's
end are left over. The experts run as grouped GEMMs over the groups; the results are gathered
back to (token, slot) order and summed with the combine weights. The copy in and the weighted
gather out, and the layout (each pair's row, a stable counting sort), are
`titan_moe.ops.moe_dispatch` (Triton on CUDA). Every shape is static and nothing syncs with the
host, so torch.compile(fullgraph=True) traces the layer.

Token chunks (`token_chunk` > 0, long context): the flattened tokens are split into chunks of
that many (the last may be shorter), each routed, dispatched (its own padded buffer) and run
under its own non-reentrant activation checkpoint (`token_chunks.checkpointed_chunks`). Routing
is per token, so the output is the same; backward, and a full-AC recompute around the layer,
then hold one chunk's expert buffers (N·k dispatched rows, grouped-GEMM and SiTU-GLU
activations) at a time instead of all T tokens'. A checkpoint's recompute runs inside backward,
so the router does not count it again in the QB statistics.
"""

import torch
from torch import nn

from titan_moe.model.norm import RMSNorm
from titan_moe.model.router import Router
from titan_moe.model.situ_glu import SiTUGLU
from titan_moe.model.token_chunks import checkpointed_chunks
from titan_moe.ops.grouped_mm import grouped_mm
from titan_moe.ops.moe_dispatch import dispatch_layout, moe_combine, moe_dispatch
from titan_moe.ops.situ_glu import situ_glu_packed


class GroupedExperts(nn.Module):
    """E SiTU-GLU experts stored stacked as nn.Linear stores a weight, [E, out, in]; grouped_mm
    takes each as its transpose [E, in, out], a column-major view. torchao's float8 grouped GEMM
    asserts that layout for its second operand ("B must be column-major": H100, torchao 0.18,
    2026-12-05), and torch._grouped_mm takes either (torchtitan's experts, stored this way, took
    the same GEMM time as ours stored [E, in, out] in bench/moe.py on the H100).

    W1 and W3 are one weight, w13 [E, 2·hidden, dim] = [W1; W3] along the output dim: one grouped
    GEMM writes a and b side by side (ab = [a | b]), SiTU-GLU reads them in place, and backward
    takes z's gradient from [∂a | ∂b] in one GEMM, where two GEMMs' [rows, dim] outputs and
    their sum (a pass over 3 such tensors) stood."""

    def __init__(
        self, n_experts: int, dim: int, hidden_dim: int, beta1: float = 4.0, beta2: float = 25.0
    ):
        super().__init__()
        self.beta1 = beta1
        self.beta2 = beta2
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [M, dim] with rows grouped by expert, offs [E] int32 cumulative group ends -> [M, dim].

        Zero rows inside a group give zero output rows (SiTU-GLU(0) = 0). Rows at or past
        offs[-1] are not computed: their output, and the gradient of x there, are unspecified
        (uninitialised on the torch._grouped_mm path), so callers must not read them.
        """
        ab = grouped_mm(x, self.w13.mT, offs, zero_padding_rows=False)
        h = situ_glu_packed(ab, self.beta1, self.beta2)
        return grouped_mm(h, self.w2.mT, offs, zero_padding_rows=False)

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        for w, std in ((self.w13, init_std), (self.w2, out_init_std)):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


class LatentMoE(nn.Module):
    """Router + latent routed experts + full-width shared experts."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        n_shared: int,
        latent_dim: int,
        expert_hidden: int,
        shared_hidden: int,
        route_scale: float = 1.0,
        beta1: float = 4.0,
        beta2: float = 25.0,
        norm_eps: float = 1e-5,
        n_bins: int = 1000,
        layer_id: int = 0,
        group_align: int = 8,
        token_chunk: int = 0,
        router_gemm: str = "split_bf16",
    ):
        super().__init__()
        if group_align < 1:
            raise ValueError(f"group_align must be >= 1, got {group_align}")
        if token_chunk < 0:
            raise ValueError(f"token_chunk must be >= 0 (0: no chunks), got {token_chunk}")
        self.n_experts = n_experts
        self.top_k = top_k
        self.group_align = group_align
        self.token_chunk = token_chunk
        self.router = Router(dim, n_experts, top_k, route_scale, n_bins, layer_id, router_gemm)
        self.w_down = nn.Linear(dim, latent_dim, bias=False)
        self.experts = GroupedExperts(n_experts, latent_dim, expert_hidden, beta1, beta2)
        self.norm = RMSNorm(latent_dim, eps=norm_eps)
        self.w_up = nn.Linear(latent_dim, dim, bias=False)
        # n_shared unweighted full-width experts summed equal one SiTU-GLU whose hidden units are
        # their concatenation: Σ_i W2_i h_i(x) = [W2_1 … W2_n] [h_1(x); …; h_n(x)].
        self.shared = SiTUGLU(dim, n_shared * shared_hidden, beta1, beta2) if n_shared > 0 else None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, dim], valid [B, T] bool (padding excluded from QB statistics) -> [B, T, dim]."""
        batch, seq, dim = x.shape
        x_flat = x.reshape(batch * seq, dim)
        valid_flat = None if valid is None else valid.reshape(-1)
        y = checkpointed_chunks(self._tokens, self.token_chunk, x_flat, valid_flat)
        return y.view(batch, seq, dim)

    def _tokens(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """x [N, dim], valid [N] bool or None -> [N, dim]: the layer over N flattened tokens."""
        # The shared expert runs first, so its backward runs last: the backward then issues the
        # routed experts' grouped GEMMs (most of its device time) early, and the shared expert's
        # launches overlap them instead of delaying them.
        shared = self.shared(x) if self.shared is not None else None
        expert_ids, weights = self.router(x, valid)
        z = self.w_down(x)
        dest, src, offs = dispatch_layout(expert_ids.reshape(-1), self.n_experts, self.group_align)
        expert_out = self.experts(moe_dispatch(z, dest, src, self.top_k), offs)
        u = moe_combine(expert_out, dest, src, weights, out_dtype=x.dtype)
        y = self.w_up(self.norm(u))
        return y if shared is None else y + shared

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        self.router.init_weights(init_std)
        nn.init.trunc_normal_(self.w_down.weight, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.experts.init_weights(init_std, out_init_std)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(
            self.w_up.weight, std=out_init_std, a=-3 * out_init_std, b=3 * out_init_std
        )
        if self.shared is not None:
            self.shared.init_weights(init_std, out_init_std)
