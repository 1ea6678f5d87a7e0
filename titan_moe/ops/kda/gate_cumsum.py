"""The gate's cumsum within each chunk, in Triton: G = cumsum(g) from the chunk start (spec §3).

With A_log and dt_bias (FUSED_GATE) g is computed here from the raw gate input, so no later
kernel redoes the gate or the cumsum: they all read G. One program per (chunk, K block,
batch*head); G is padded to Tp = cdiv(T, C) * C rows, the rows past T holding g = 0.
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.chunk_common import chunk_documents, kda_gate_from_raw, rounded_to


@triton.jit
def gate_cumsum_kernel(
    g, A_log, dt_bias, G_out, g_min, T,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
    FUSED_GATE: tl.constexpr,
):  # fmt: skip
    """G [B,Tp,H,K] fp32 from g [B,T,H,K] (the gate, or its raw input with FUSED_GATE)."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64.
    g_min = tl.cast(g_min, tl.float32)
    chunk, k_block, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(0) * C
    rows = tl.arange(0, C)
    cols_k = k_block * BK + tl.arange(0, BK)
    k_ok = cols_k < K
    in_mask = (t0 + rows < T)[:, None] & k_ok[None, :]
    g_c = tl.load(g + ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                  mask=in_mask, other=0.0).to(tl.float32)
    if FUSED_GATE:
        A_log_h = tl.load(A_log + h).to(tl.float32)
        dt_row = tl.load(dt_bias + h * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
        g_c = tl.where(in_mask, kda_gate_from_raw(g_c, A_log_h, dt_row, g_min), 0.0)
    tl.store(G_out + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
             tl.cumsum(g_c, axis=0), mask=k_ok[None, :])


@triton.jit
def gate_cumsum_bwd_kernel(
    g, A_log, dt_bias, G, d_end_parts, d_gamma, dG, doc, dg, d_gate_params, g_min, T,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, TILES: tl.constexpr,
    HAS_DOCS: tl.constexpr, FUSED_GATE: tl.constexpr,
):  # fmt: skip
    """dg [B,T,H,K] in g's dtype (of g_raw with FUSED_GATE): the reverse cumsum of dG within
    the chunk. With FUSED_GATE also the chunk's share of the gate parameters' gradients,
    d_gate_params [2, B, n_chunks, H, K] fp32: sum_t dg (dt_bias's) and sum_t dg (g_raw +
    dt_bias) (A_log's, before its sum over K). They are summed from the fp32 dg here, in the
    pass that already holds it, where summing them outside read dg and g_raw again and wrote two
    more [B,T,H,K] fp32 tensors (g_raw + dt_bias and its product with dg).

    gamma_C = exp(G_C) reaches G's last row twice: through K_d = (gamma_C / Gamma) K, as
    sum_r K_d dK_d, and as the state's carry (when the chunk's last document continues from
    the previous chunk), as gamma_C sum_v S dS = gamma_C d_gamma. The first comes summed by
    16-row tiles (TILES a chunk) from tile_products_bwd_kernel, in fp32 from k and G as the
    forward's K_d (the UT transform stores K_d as the scans' bf16 operand), so this kernel
    reads dG, g_raw and a row a chunk of G, not k, G and dK_d: about 1.07 of 2.31 kB a token
    and head at K = 128 with the fused gate (bf16 inputs, dg written), 0.82 of 2.05 without.
    """
    g_min = tl.cast(g_min, tl.float32)
    chunk, k_block, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    t0 = chunk * C
    Tp = n_chunks * C
    rows = tl.arange(0, C)
    cols_k = k_block * BK + tl.arange(0, BK)
    k_ok = cols_k < K
    pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    dG_c = tl.load(dG + pad_offs, mask=k_ok[None, :], other=0.0)
    G_end = tl.load(G + ((b * Tp + t0 + C - 1) * H + h) * K + cols_k, mask=k_ok, other=0.0)
    d_gamma_c = tl.load(d_gamma + ((b * n_chunks + chunk) * H + h) * K + cols_k, mask=k_ok,
                        other=0.0)
    _, d_before, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    tiles = tl.arange(0, TILES)
    parts = tl.load(d_end_parts + (((b * n_chunks + chunk) * TILES + tiles) * H + h)[:, None] * K
                    + cols_k[None, :], mask=k_ok[None, :], other=0.0)
    dG_end = tl.sum(parts, axis=0) + tl.where(d_last == d_before, tl.exp(G_end) * d_gamma_c, 0.0)
    in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    in_mask = (t0 + rows < T)[:, None] & k_ok[None, :]
    dG_c += tl.where(rows[:, None] == C - 1, dG_end[None, :], 0.0)
    dg_c = tl.cumsum(dG_c, axis=0, reverse=True)
    if FUSED_GATE:
        A_log_h = tl.load(A_log + h).to(tl.float32)
        g_raw = tl.load(g + in_offs, mask=in_mask, other=0.0).to(tl.float32)
        dt_row = tl.load(dt_bias + h * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
        pre = g_raw + dt_row[None, :]
        gate = tl.sigmoid(tl.exp(A_log_h) * pre)
        dg_c = tl.where(in_mask, dg_c * g_min * gate * (1.0 - gate) * tl.exp(A_log_h), 0.0)
        part = ((b * n_chunks + chunk) * H + h) * K + cols_k
        plane = tl.num_programs(2) * n_chunks * K  # B * n_chunks * H * K
        tl.store(d_gate_params + part, tl.sum(dg_c, axis=0), mask=k_ok)
        tl.store(d_gate_params + plane + part, tl.sum(dg_c * pre, axis=0), mask=k_ok)
    tl.store(dg + in_offs, rounded_to(dg_c, dg.dtype.element_ty), mask=in_mask)
