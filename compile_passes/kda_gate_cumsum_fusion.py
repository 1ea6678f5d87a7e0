"""Inductor pass: the KDA gate and its chunk-local cumsum as one kernel on the PyTorch path.

On CUDA `chunk_kda_fused_gate` runs the Triton op, whose kernels compute the gate
g = g_min σ(exp(A_log)(g_raw + dt_bias)) and G = cumsum_chunk(g) themselves. Elsewhere (CPU,
float64) it computes g with `kda_gate` and `chunk_kda_torch` takes G = g.cumsum(-2) over the
chunk-major view; Inductor has no CPU scan, so that is a gate kernel writing g, then ATen's
cumsum reading it back (and a flip + cumsum + flip in the backward). The replacement writes the
cumsum as a masked sum over the C = 64 positions of the chunk,

    G[.., r, :] = Σ_j [j ≤ r] · gate(g_raw[.., j, :])

a reduction with the gate inlined into its loop: one kernel that reads g_raw once and writes G
(the backward, the reversed masked sum times the gate's derivative, is one kernel as well, plus
the reduction for A_log and dt_bias). It trades C-fold gate arithmetic for the round trip of g
through memory; bench/compile.py measures both. The patterns are traced from `kda_gate` and
`chunk_kda_torch`'s own chunking.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.pattern_matcher import (
    PatternMatcherPass,
    fwd_only,
    joint_fwd_bwd,
    register_replacement,
)

from titan_moe.ops.kda import CHUNK_SIZE
from titan_moe.ops.kda.gate import kda_gate

NAME = "kda_gate"
G_MIN = -5.0  # the traced pattern's bound, captured as a match argument
PATTERN_DTYPES = (torch.float32, torch.float64)


def _chunked(g: Tensor, heads: int) -> Tensor:
    """chunk_kda_torch's `to_chunks` at a sequence length that is a multiple of the chunk."""
    batch, seq_len = g.shape[:2]
    g = F.pad(g, (0, 0, 0, 0, 0, 0))
    return g.view(batch, seq_len // CHUNK_SIZE, CHUNK_SIZE, heads, -1).permute(0, 3, 1, 2, 4)


def _search(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, g_min: float) -> Tensor:
    return _chunked(kda_gate(g_raw, A_log, dt_bias, g_min), g_raw.shape[2]).cumsum(-2)


def gate_chunk_cumsum(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, g_min: float) -> Tensor:
    """The replacement: G [B,H,NC,C,K] as a masked sum of the gate over the chunk."""
    g = _chunked(kda_gate(g_raw, A_log, dt_bias, g_min), g_raw.shape[2])  # [B,H,NC,C,K]
    position = torch.arange(CHUNK_SIZE, device=g_raw.device)
    upto = (position[None, :] <= position[:, None]).to(g.dtype)  # [r, j]
    return (upto[:, :, None] * g.unsqueeze(-3)).sum(-2)


@functools.cache
def pattern_pass() -> PatternMatcherPass:
    patterns = PatternMatcherPass(pass_name=f"compile_passes.{NAME}")
    heads, d_k = 2, 16
    for dtype in PATTERN_DTYPES:
        for trace_fn, grad in ((joint_fwd_bwd, True), (fwd_only, False)):
            example = [
                torch.empty(1, CHUNK_SIZE, heads, d_k, dtype=dtype, requires_grad=grad),
                torch.empty(heads, requires_grad=grad),
                torch.empty(heads * d_k, requires_grad=grad),
            ]
            register_replacement(
                _search,
                gate_chunk_cumsum,
                example,
                trace_fn,
                patterns,
                scalar_workaround={"g_min": G_MIN},
            )
    return patterns
