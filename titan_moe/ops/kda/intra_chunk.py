"""KDA within one chunk, in Triton: the decayed products, the UT transform and W, U (spec §3).

For a chunk of C = 64 tokens with G = cumsum(g) from the chunk start and Gamma = exp(G):
    A_qk[r,j] = sum_c q_rc k_jc exp(G_rc - G_jc)        j <= r, same document
    KK[r,j]   = sum_c k_rc k_jc exp(G_rc - G_jc)        j <  r, same document
    Tinv = (I + Diag(beta) KK)^{-1},   W = Tinv (beta * Gamma * K),   U = Tinv (beta * V)
One program per (chunk, batch*head). It also writes G, so that the later kernels never redo
the gate or the cumsum.

Numeric range, the reason the 16-token tiles are dense tensor-core GEMMs: with g in [-5, 0]
(the lower-bounded gate), exp(G_r - G_j) is split at the first row n of r's 16-row tile as
exp(G_r - G_n) * exp(G_n - G_j). The row factor is <= 1. The column factor is <= 1 left of the
tile and at most exp(15 * 5) = exp(75) inside it, below fp32's exp(88) ceiling; columns right of
the tile would overflow, so their exponent is zeroed before the exp and the operand masked.
Every product term is finite; the j > r triangle of the diagonal tile is masked after the GEMM.
"""

import triton
import triton.language as tl

# The training chunk: 64 tokens = four 16-token diagonal tiles.
CHUNK = 64
SUBTILE = 16


@triton.jit
def kda_gate_from_raw(g_raw, A_log_h, dt_bias_row, g_min):
    """g = g_min * sigmoid(exp(A_log_h) * (g_raw + dt_bias)): the lower-bounded gate."""
    return g_min * tl.sigmoid(tl.exp(A_log_h) * (g_raw + dt_bias_row[None, :]))


@triton.jit
def tile_decay_factors(G, rows, i, SUBTILE: tl.constexpr):
    """(row factor, column factor) of row tile i, referenced at its first row n.

    Row factor exp(G_r - G_n) for r in the tile (0 elsewhere: those rows take no part);
    column factor exp(G_n - G_j) for j before the tile's end (0 after it, never overflowing).
    """
    in_tile = (rows >= i * SUBTILE) & (rows < (i + 1) * SUBTILE)
    reach = rows < (i + 1) * SUBTILE
    G_ref = tl.sum(tl.where(rows[:, None] == i * SUBTILE, G, 0.0), axis=0)
    row_factor = tl.where(in_tile[:, None], tl.exp(tl.where(in_tile[:, None], G - G_ref[None, :],
                                                             0.0)), 0.0)
    col_factor = tl.where(reach[:, None], tl.exp(tl.where(reach[:, None], G_ref[None, :] - G,
                                                           0.0)), 0.0)
    return row_factor, col_factor


@triton.jit
def decayed_products(rows_op, cols_op, G, rows, C: tl.constexpr, SUBTILE: tl.constexpr,
                     PRECISION: tl.constexpr):
    """P[r,j] = sum_c rows_op[r,c] cols_op[j,c] exp(G_rc - G_jc) for j in or before r's tile."""
    P = tl.zeros((C, C), dtype=tl.float32)
    for i in tl.range(0, C // SUBTILE, num_stages=1):
        row_factor, col_factor = tile_decay_factors(G, rows, i, SUBTILE)
        P += tl.dot(rows_op * row_factor, tl.trans(cols_op * col_factor),
                    input_precision=PRECISION)
    return P


@triton.jit
def unit_lower_inverse(L, rows, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^{-1} for strictly lower L [C, C], by blocked forward substitution.

    Blocks double 1, 2, ..., C/2: with the diagonal blocks of size s inverted (inv),
    [[A, 0], [E, D]]^{-1} = inv - inv E inv, E being L's couplings between the halves of each
    2s-block. Unlike the Neumann product, no growing powers of L cancel, so fp32 keeps its digits.
    """
    tl.static_assert(C == 64)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    block = 1
    for _ in tl.static_range(6):
        same_pair = (rows[:, None] // (2 * block)) == (rows[None, :] // (2 * block))
        upper_row = ((rows[:, None] // block) % 2) == 1
        lower_col = ((rows[None, :] // block) % 2) == 0
        coupling = tl.where(same_pair & upper_row & lower_col, L, 0.0)
        inv = inv - tl.dot(tl.dot(inv, coupling, input_precision=PRECISION), inv,
                           input_precision=PRECISION)
        block *= 2
    return inv


@triton.jit
def chunk_documents(doc, b, t0, rows, T, C: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Per-row document ids of a chunk, the id before it and the id of its last valid token.

    Rows past T take the last valid token's document, so padding never starts a document. The
    first chunk continues from the row's initial state.
    """
    if HAS_DOCS:
        last_valid = tl.minimum(t0 + C - 1, T - 1)
        d_last = tl.load(doc + b * T + last_valid)
        d = tl.load(doc + b * T + t0 + rows, mask=t0 + rows < T, other=0)
        d = tl.where(t0 + rows < T, d, d_last)
        d_before = tl.load(doc + b * T + tl.maximum(t0 - 1, 0))
    else:
        d = tl.zeros_like(rows)
        d_last = 0
        d_before = 0
    return d, d_before, d_last


@triton.jit
def chunk_intra_kernel(
    q, k, v, g, beta, doc, A_log, dt_bias,
    G_out, A_qk, KK, Tinv, W, U,
    scale, g_min, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, SUBTILE: tl.constexpr, HAS_DOCS: tl.constexpr, FUSED_GATE: tl.constexpr,
    STORE_BWD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """G [B,Tp,H,K], A_qk [B,Tp,H,C], W [B,Tp,H,K], U [B,Tp,H,V] (+ KK, Tinv for backward).

    Inputs are [B,T,H,*]; outputs are padded to Tp = cdiv(T, C) * C. Rows past T load as zero
    (g = 0, beta = 0, k = 0: they leave the state untouched).
    """
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale, g_min = tl.cast(scale, tl.float32), tl.cast(g_min, tl.float32)
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(0) * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    in_mask = valid[:, None] & k_ok[None, :]
    out_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]

    k_c = tl.load(k + in_offs, mask=in_mask, other=0.0).to(tl.float32)
    q_c = tl.load(q + in_offs, mask=in_mask, other=0.0).to(tl.float32) * scale
    g_c = tl.load(g + in_offs, mask=in_mask, other=0.0).to(tl.float32)
    if FUSED_GATE:
        A_log_h = tl.load(A_log + h).to(tl.float32)
        dt_row = tl.load(dt_bias + h * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
        g_c = tl.where(in_mask, kda_gate_from_raw(g_c, A_log_h, dt_row, g_min), 0.0)
    G = tl.cumsum(g_c, axis=0)
    tl.store(G_out + out_offs, G, mask=k_ok[None, :])
    beta_c = tl.load(beta + (b * T + t0 + rows) * H + h, mask=valid, other=0.0).to(tl.float32)

    d, _, _ = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    same_doc = d[:, None] == d[None, :]
    causal = (rows[:, None] >= rows[None, :]) & same_doc
    strict = (rows[:, None] > rows[None, :]) & same_doc
    A = tl.where(causal, decayed_products(q_c, k_c, G, rows, C, SUBTILE, PRECISION), 0.0)
    P = tl.where(strict, decayed_products(k_c, k_c, G, rows, C, SUBTILE, PRECISION), 0.0)
    inv = unit_lower_inverse(beta_c[:, None] * P, rows, C, PRECISION)

    cc_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :]
    tl.store(A_qk + cc_offs, A)
    if STORE_BWD:
        tl.store(KK + cc_offs, P)
        tl.store(Tinv + cc_offs, inv)
    M = inv * beta_c[None, :]
    tl.store(W + out_offs, tl.dot(M, k_c * tl.exp(G), input_precision=PRECISION),
             mask=k_ok[None, :])
    for v0 in tl.static_range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        v_in = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        v_c = tl.load(v + v_in, mask=valid[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        v_out = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        tl.store(U + v_out, tl.dot(M, v_c, input_precision=PRECISION), mask=v_ok[None, :])
