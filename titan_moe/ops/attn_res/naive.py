"""One Block Attention Residuals site (spec §2) in plain PyTorch: the reference for the Triton op
(`attn_res_triton.py`) and the path CPU tensors take.

For n sources V_i ([..., d], all the same shape; one row = one token) and u = γ ⊙ w (gain and
pseudo-query, [d]), per row:

    r_i = rsqrt(mean_d(V_i²) + eps)          (so key_i = r_i V_i)
    s_i = r_i · <V_i, u>                     (= <key_i, u>)
    p   = softmax_i(s)
    out = Σ_i p_i V_i                        (the raw, un-normalised sources)

and, given g = dL/dout,

    dp_i = <g, V_i>;   c = Σ_j p_j dp_j      (= <g, out>)
    ds_i = p_i (dp_i - c)
    dV_i = p_i g + ds_i r_i u - (ds_i s_i r_i² / d) V_i
    du   = Σ_rows Σ_i ds_i r_i V_i;   dγ = du ⊙ w,   dw = du ⊙ γ

(the backward is autograd's here; tests/ops/test_attn_res.py checks it against these formulas).
"""

import torch
from torch import Tensor

MAX_SOURCES = 9  # the Triton op's limit; the reference takes any n >= 1


def validate_attn_res_inputs(
    sources: list[Tensor] | tuple[Tensor, ...], query: Tensor, gain: Tensor, max_sources: int | None
) -> None:
    """One ValueError naming what is wrong: the number of sources, their shapes, dtypes or
    devices, or the shape of query / gain."""
    n = len(sources)
    if n < 1 or (max_sources is not None and n > max_sources):
        limit = "" if max_sources is None else f" and at most {max_sources}"
        raise ValueError(f"attn_res: need at least 1{limit} sources, got n={n}")
    shape = sources[0].shape
    if len(shape) < 1:
        raise ValueError("attn_res: sources must be [..., d], got a 0-dim tensor")
    for i, v in enumerate(sources):
        if v.shape != shape:
            raise ValueError(f"attn_res: every source must have source 0's shape {tuple(shape)}, "
                             f"source {i} is {tuple(v.shape)}")
        if not v.dtype.is_floating_point:
            raise ValueError(f"attn_res: sources must be floating point, source {i} is {v.dtype}")
        if v.device != sources[0].device:
            raise ValueError(f"attn_res: source {i} is on {v.device}, source 0 on "
                             f"{sources[0].device}")
    dim = shape[-1]
    for name, t in (("query", query), ("gain", gain)):
        if t.shape != (dim,):
            raise ValueError(f"attn_res: {name} must be [d]=[{dim}], got {tuple(t.shape)}")


def attn_res_mix_naive(
    sources: list[Tensor], query: Tensor, gain: Tensor, eps: float
) -> Tensor:
    """The site's output in fp32 (float64 for float64 sources), never in AMP's bf16: autocast is
    off inside. Stacks the sources into [n, ..., d]; the score is a matrix-vector product."""
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    with torch.autocast(sources[0].device.type, enabled=False):
        v = torch.stack(sources).to(dtype)
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        scores = keys @ (gain * query).to(dtype)
        p = torch.softmax(scores, dim=0)
        return (p.unsqueeze(-1) * v).sum(0)
