"""Kimi Delta Attention layer (spec §3).

    q̃, k̃, ṽ = SiLU(CausalConv_4(W_q x)), SiLU(CausalConv_4(W_k x)), SiLU(CausalConv_4(W_v x))
    q = L2norm(q̃) (the op applies d_k^-1/2),  k = L2norm(k̃),  β = σ(W_β x)
    g = g_min · σ(exp(A_log) · (W_f↑ W_f↓ x + dt_bias))        ∈ (g_min, 0], g_min = −5
    S_t = Diag(e^{g_t}) S_{t−1} + β_t k_t (v_t − (Diag(e^{g_t}) S_{t−1})ᵀ k_t)ᵀ,  o_t = S_tᵀ q_t
    y = W_o concat_h[σ(W_g x)_h ⊙ RMSNorm_{d_v}(o_h)]

The convolution and the recurrence both restart at every document start given by `doc_ids`.
Decoding (`state`, a KDAState) carries the recurrent state S and the last conv_size - 1 conv
inputs across calls: constant memory in the context length.

Long context (`seq_segment` > 0, training): the layer runs by segments of that many positions,
each whole (projections, short conv, recurrence, output gate, norm and W_o) under its own
non-reentrant checkpoint, so a backward (and a full-AC recompute around the layer) holds one
segment's q, k, v, conv outputs and gates instead of all T positions'. A segment starts from the
previous one's state S (zeroed in the rows where a document begins with the segment) and its
last conv_size - 1 conv inputs, the conv's halo (dropped by the conv where their document
differs); outputs and gradients equal the whole layer's up to the order of sums.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.norm import RMSNorm
from titan_moe.ops.kda import (
    chunk_kda,
    chunk_kda_fused_gate,
    kda_gate,
    recurrent_kda_step,
    resolve_backend,
)
from titan_moe.ops.short_conv import causal_depthwise_conv, short_conv


@dataclass
class KDAState:
    """One KDA layer's decode state per row: S [B,H,K,V] fp32, conv taps [B, conv-1, 3·H·K]."""

    recurrent: torch.Tensor
    conv: torch.Tensor

    def update(self, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """The state after a call: rebound (autograd can flow through it)."""
        self.recurrent, self.conv = recurrent, conv


class StaticKDAState(KDAState):
    """A KDAState whose tensors are written in place: their addresses never change, so a
    compiled, CUDA-graphed decode step reads and writes the same buffers every step."""

    def update(self, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        self.recurrent.copy_(recurrent)
        self.conv.copy_(conv)


def last_valid(window: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """The last n rows of window [B, n + T, C] whose mask is set; the first n always count."""
    keep = torch.cat([valid.new_ones(valid.shape[0], n), valid], 1).to(torch.int8)
    order = torch.sort(keep, dim=1, stable=True).indices
    order = order[:, order.shape[1] - n :]
    return window.gather(1, order.unsqueeze(-1).expand(-1, -1, window.shape[-1]))


class KimiDeltaAttention(nn.Module):
    # The two steps that mix along the sequence. Context parallelism
    # (titan_moe/parallel/context_parallel.py) replaces them per instance with versions that
    # exchange the conv halo and the state. sequence_conv_act(x, weight, doc_ids, head_dim) is
    # the short convolution: causal conv, SiLU and (head_dim) the per-head L2 norm of q and k.
    # Segments (seq_segment) call them per segment, the recurrence with initial_state and
    # output_final_state, which context parallelism's does not take: the two exclude each other.
    sequence_conv_act = staticmethod(short_conv)
    sequence_recurrence = staticmethod(chunk_kda_fused_gate)

    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.g_min = args.kda_g_min
        self.kda_backend = resolve_backend(args.kda_backend)
        self.seq_segment = args.seq_segment
        inner = args.n_heads * args.head_dim
        self.w_q = nn.Linear(args.dim, inner, bias=False)
        self.w_k = nn.Linear(args.dim, inner, bias=False)
        self.w_v = nn.Linear(args.dim, inner, bias=False)
        self.conv_q = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.conv_k = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.conv_v = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.w_f_down = nn.Linear(args.dim, args.kda_gate_rank, bias=False)
        self.w_f_up = nn.Linear(args.kda_gate_rank, inner, bias=False)
        self.A_log = nn.Parameter(torch.zeros(args.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(inner, dtype=torch.float32))
        self.w_beta = nn.Linear(args.dim, args.n_heads, bias=False)
        self.w_g = nn.Linear(args.dim, inner, bias=False)
        self.o_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.w_o = nn.Linear(inner, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        cache: KDAState | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B,T,d]. With `cache` (decoding) each row is one document continued from the state,
        `valid` [B,T] bool marks its real tokens (they come first in the call), and the state is
        advanced past them."""
        if cache is not None:
            return self._forward_with_state(x, cache, valid)
        if 0 < self.seq_segment < x.shape[1]:
            return self._forward_by_segments(x, doc_ids)
        return self._forward_whole(x, doc_ids)

    def _forward_whole(self, x: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """forward over all T positions at once (no segments, no state)."""
        b, t, _ = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        q, k, v = self._conv_act(self._conv_inputs(x), doc_ids, shape)
        beta, g_raw = self._gate_inputs(x, q.dtype, shape)
        o, _ = self.sequence_recurrence(q, k, v, g_raw, self.A_log, self.dt_bias, beta, self.g_min,
                                        doc_ids=doc_ids, backend=self.kda_backend)
        return self._output(o, x)

    def _forward_by_segments(self, x: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """forward over segments of seq_segment positions, each under its own checkpoint, the
        recurrent state and the conv taps passed from one to the next."""
        n_taps = self.conv_q.shape[-1] - 1
        outputs, state, taps, start = [], None, (), 0
        for xs in x.split(self.seq_segment, 1):  # split: its backward is one cat
            end = start + xs.shape[1]
            docs = tap_docs = None
            if doc_ids is not None:
                docs = doc_ids[:, start:end]
                if start:
                    tap_docs = doc_ids[:, start - n_taps:start]
                    # The state restarts in the rows where a document begins with this segment
                    # (the op seeds each row's first document with initial_state).
                    same = doc_ids[:, start] == doc_ids[:, start - 1]
                    state = torch.where(same.view(-1, 1, 1, 1), state, 0.0)
            # The layer draws no random numbers: no RNG state to save and restore.
            y, state, *taps = checkpoint(self._segment, xs, docs, state, tap_docs, *taps,
                                         use_reentrant=False, preserve_rng_state=False)
            # Copies, made here: the taps are views of this segment's whole conv inputs, which
            # the next segment's checkpoint would keep alive (and a full-AC recompute would
            # hold for every segment). Inside a compiled _segment Inductor returned a clone of
            # them as a view of the whole buffer: 3 rows of d a position held in such a recompute.
            taps = [tap.clone() for tap in taps]
            outputs.append(y)
            start = end
        return torch.cat(outputs, 1)

    def _segment(
        self,
        x: torch.Tensor,
        doc_ids: torch.Tensor | None,
        state: torch.Tensor | None,
        tap_docs: torch.Tensor | None,
        *taps: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """The layer over a segment x [B,T,d] that continues the previous one: from its
        recurrent state and its last conv_size - 1 conv inputs of q, k and v (`taps`, of the
        documents `tap_docs`); none for the first segment. Returns (y, the state after this
        segment, this segment's last conv_size - 1 conv inputs of q, k and v, as views)."""
        # A segment of rows > 1 is a strided view: one copy the projections share, where each
        # would copy it for its GEMM (and save its copy).
        x = x.contiguous()
        b, t, _ = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        window, window_docs, halo = self._conv_inputs(x), doc_ids, 0
        if taps:  # the causal conv's halo; the conv drops taps of an earlier document
            window = [torch.cat([tap, z], 1) for tap, z in zip(taps, window, strict=True)]
            window_docs = None if doc_ids is None else torch.cat([tap_docs, doc_ids], 1)
            halo = taps[0].shape[1]
        q, k, v = self._conv_act(window, window_docs, shape, halo)
        beta, g_raw = self._gate_inputs(x, q.dtype, shape)
        o, final = self.sequence_recurrence(q, k, v, g_raw, self.A_log, self.dt_bias, beta,
                                            self.g_min, initial_state=state,
                                            output_final_state=True, doc_ids=doc_ids,
                                            backend=self.kda_backend)
        # Views: the caller copies them (_forward_by_segments says why).
        n_taps = self.conv_q.shape[-1] - 1
        return self._output(o, x), final, *(z[:, z.shape[1] - n_taps:] for z in window)

    def _conv_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The projections the short convs run over: W_q x, W_k x, W_v x."""
        return [self.w_q(x), self.w_k(x), self.w_v(x)]

    def _conv_act(
        self, inputs: list[torch.Tensor], doc_ids: torch.Tensor | None, shape: tuple[int, ...],
        halo: int = 0,
    ) -> list[torch.Tensor]:
        """q, k, v [B,T,H,K] from their conv inputs [B, halo + T, H·K], the first halo rows
        (the previous segment's) cut off after the conv."""
        # The recurrence takes its inputs in the projections' dtype (bf16 under autocast), not
        # the residual stream's (fp32 under autocast): the kernels compute in fp32 either way,
        # but fp32 inputs select IEEE fp32 GEMMs, several times slower and minutes to compile.
        # The short conv computes in fp32 and returns its input's dtype, the projections'.
        weights = (self.conv_q, self.conv_k, self.conv_v)
        norms = (self.head_dim, self.head_dim, None)
        outputs = [self.sequence_conv_act(z, w, doc_ids, n)
                   for z, w, n in zip(inputs, weights, norms, strict=True)]
        return [(y[:, halo:] if halo else y).view(shape) for y in outputs]

    def _gate_inputs(
        self, x: torch.Tensor, act: torch.dtype, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """β = σ(W_β x) (at least fp32) and the gate's low-rank input W_f↑ W_f↓ x [B,T,H,K]."""
        wide = torch.promote_types(act, torch.float32)
        beta = torch.sigmoid(self.w_beta(x).to(wide))
        return beta, self.w_f_up(self.w_f_down(x)).view(shape)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y = W_o concat_h[σ(W_g x)_h ⊙ RMSNorm(o_h)]."""
        b, t = o.shape[:2]
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(self.w_g(x)).view(o.shape)
        return self.w_o(o.reshape(b, t, -1))

    def _forward_with_state(
        self, x: torch.Tensor, state: KDAState, valid: torch.Tensor | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        mask = valid.unsqueeze(-1)
        # Invalid tokens must be exact no-ops: zero conv inputs, beta = 0 (no write), g = 0.
        qkv = torch.where(mask, torch.cat([self.w_q(x), self.w_k(x), self.w_v(x)], -1), 0.0)
        taps = state.conv.shape[1]
        window = torch.cat([state.conv.to(qkv.dtype), qkv], 1)
        weight = torch.cat([self.conv_q, self.conv_k, self.conv_v])
        mixed = F.silu(causal_depthwise_conv(window, weight)[:, taps:])
        conv = last_valid(window, valid, taps)
        q, k, v = (z.reshape(shape) for z in mixed.chunk(3, -1))
        act = qkv.dtype  # the projections' dtype, as in forward
        wide = torch.promote_types(act, torch.float32)
        q = F.normalize(q.to(wide), dim=-1, eps=1e-6).to(act)
        k = F.normalize(k.to(wide), dim=-1, eps=1e-6).to(act)
        beta = torch.where(mask, torch.sigmoid(self.w_beta(x).to(wide)), 0.0)
        g = kda_gate(self.w_f_up(self.w_f_down(x)).view(shape), self.A_log, self.dt_bias,
                     self.g_min)
        g = torch.where(mask.unsqueeze(-1), g, 0.0)
        if t == 1:
            o, recurrent = recurrent_kda_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent,
                self.head_dim**-0.5)
            o = o.unsqueeze(1)
        else:
            o, recurrent = chunk_kda(q, k, v, g, beta, initial_state=state.recurrent,
                                     output_final_state=True, backend=self.kda_backend)
        state.update(recurrent, conv)
        return self._output(o, x)

    def new_cache(self, batch: int) -> KDAState:
        """An empty decode state (nothing seen yet) on the layer's device and dtype."""
        weight = self.w_q.weight
        inner = self.n_heads * self.head_dim
        recurrent = torch.zeros(batch, self.n_heads, self.head_dim, self.head_dim,
                                device=weight.device,
                                dtype=torch.promote_types(weight.dtype, torch.float32))
        conv = weight.new_zeros(batch, self.conv_q.shape[-1] - 1, 3 * inner)
        return KDAState(recurrent, conv)

    def new_static_cache(self, batch: int, max_len: int = 0) -> StaticKDAState:
        """new_cache's state, updated in place (max_len is unused: the state is constant)."""
        state = self.new_cache(batch)
        return StaticKDAState(state.recurrent, state.conv)

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        for lin in (self.w_q, self.w_k, self.w_v, self.w_f_down, self.w_f_up, self.w_beta,
                    self.w_g):
            nn.init.trunc_normal_(lin.weight, std=init_std)
        nn.init.trunc_normal_(self.w_o.weight, std=out_init_std)
        bound = 1.0 / math.sqrt(self.conv_q.shape[-1])
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.uniform_(conv, -bound, bound)
        with torch.no_grad():
            self.A_log.zero_()
            init_dt_bias_(self.dt_bias, 1e-3, 1e-1)
        self.o_norm.reset_parameters()


@torch.no_grad()
def init_dt_bias_(dt_bias: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """In place: dt ~ LogUniform[low, high], stored as softplus⁻¹(dt) = dt + log(−expm1(−dt)).

    Built from the parameter itself, so it also works on an FSDP-sharded (DTensor) parameter.
    """
    dt = dt_bias.uniform_(math.log(low), math.log(high)).exp_()
    return dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
