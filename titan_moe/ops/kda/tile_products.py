"""The decayed products of one chunk by 16-row tiles, in Triton: A_qk and KK (spec §3).

    A_qk[r,j] = sum_c q_rc k_jc exp(G_rc - G_jc)   j <= r, same document
    KK[r,j]   = sum_c k_rc k_jc exp(G_rc - G_jc)   j <  r, same document
One program per (16-row tile, chunk, batch*head), referenced at the tile's first row n
(chunk_common.py gives the numeric range), writes its 16 rows of the chunk's C columns by one
loop over K blocks of [16, BK] x [BK, C] GEMMs on OPERAND operands (bf16 for half-precision
inputs), each K block's q, k, G rows loaded and decayed once: the columns before the tile (both
factors exp(G_r - G_n) and exp(G_n - G_j) are <= 1 there), the tile itself (the column factor up
to exp(75), inside bf16's exponent range) and the zero columns after it (operand masked: no
load, 1.6x the needed GEMM work, in 2 GEMMs a K block where 16-wide blocks took up to 8, with
their rows reloaded for each). Rounding the factored operands costs
2^-9 of each term: over bf16 inputs, the op as it is, the output's error is at most 3.5e-3
relative RMS against float64 (bound 5e-3; 1.7e-3, its own rounding to bf16, on fp32 operands),
under the interpreter rounding to bf16 as the GPU does (chunk_common.round_to_bf16). So no GEMM
is masked down to 16 rows, and the tiles are small (96 registers a thread at 4 warps and three
stages on sm_90, no spill; bench/kda_compile.py).
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.chunk_common import chunk_documents, mma, rounded_to


@triton.jit
def tile_products_kernel(
    q, k, G, doc, A_qk, KK, scale, T,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SUBTILE: tl.constexpr,
    HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    """A_qk, KK [B,Tp,H,C] fp32 (row r's products with the chunk's C tokens, masked)."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale = tl.cast(scale, tl.float32)
    # A chunk's tiles are adjacent in launch order, so its k and G are read from DRAM once.
    tile, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(1) * C
    ref = tile * SUBTILE
    rows = ref + tl.arange(0, SUBTILE)
    cols = tl.arange(0, C)
    # The columns up to the tile's end; those after it are zero: not loaded, their exponent
    # (which would overflow) zeroed.
    upto = cols < ref + SUBTILE
    A = tl.zeros((SUBTILE, C), dtype=tl.float32)
    P = tl.zeros((SUBTILE, C), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        k_ok = cols_k < K
        row_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        row_mask = (t0 + rows < T)[:, None] & k_ok[None, :]
        q_r = tl.load(q + row_offs, mask=row_mask, other=0.0).to(tl.float32) * scale
        k_r = tl.load(k + row_offs, mask=row_mask, other=0.0).to(tl.float32)
        G_r = tl.load(G + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                      mask=k_ok[None, :], other=0.0)
        G_ref = tl.load(G + ((b * Tp + t0 + ref) * H + h) * K + cols_k, mask=k_ok, other=0.0)
        row_factor = tl.exp(G_r - G_ref[None, :])
        col_offs = ((b * T + t0 + cols) * H + h)[:, None] * K + cols_k[None, :]
        k_c = tl.load(k + col_offs, mask=(upto & (t0 + cols < T))[:, None] & k_ok[None, :],
                      other=0.0).to(tl.float32)
        G_c = tl.load(G + ((b * Tp + t0 + cols) * H + h)[:, None] * K + cols_k[None, :],
                      mask=upto[:, None] & k_ok[None, :], other=0.0)
        k_col = tl.trans(k_c * tl.exp(tl.where(upto[:, None], G_ref[None, :] - G_c, 0.0)))
        A += mma(q_r * row_factor, k_col, OPERAND)
        P += mma(k_r * row_factor, k_col, OPERAND)
    d_rows, _, _ = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    d_cols, _, _ = chunk_documents(doc, b, t0, cols, T, C, HAS_DOCS)
    same_doc = d_rows[:, None] == d_cols[None, :]
    base = ((b * Tp + t0 + rows) * H + h)[:, None] * C + cols[None, :]
    tl.store(A_qk + base, tl.where(same_doc & (cols[None, :] <= rows[:, None]), A, 0.0))
    tl.store(KK + base, tl.where(same_doc & (cols[None, :] < rows[:, None]), P, 0.0))


# BLOCK_LOOPS: compiled, tile_products_bwd_kernel walks the other 16-row blocks of its chunk in
# two `for` loops with runtime bounds (the tile's index), which Triton's pipeliner turns into
# asynchronous copies: block j + 1's k, q, G and dA, dKK load while block j's GEMMs run. Triton
# 3.6's interpreter holds scalars as 1-element arrays, which range() cannot take under NumPy 2,
# so interpreted (INTERPRETED) it runs the same bodies in `while` loops (state_scan.py does
# the same).


@triton.jit
def _row_terms(dq_acc, dk_acc, j, k, G, dA, dP, G_n, cc_rows, b, h, t0, T, Tp, cols_k, k_ok,
               tile_cols, H: tl.constexpr, K: tl.constexpr, SUBTILE: tl.constexpr,
               PRECISION: tl.constexpr):
    """Block j (before the tile)'s share of the tile rows' dq and dk, at n: dA and dKK's
    [16, 16] block times k_j exp(G_n - G_j) (<= 1)."""
    block = j * SUBTILE + tile_cols
    G_j = tl.load(G + ((b * Tp + t0 + block) * H + h)[:, None] * K + cols_k[None, :],
                  mask=k_ok[None, :], other=0.0)
    k_j = tl.load(k + ((b * T + t0 + block) * H + h)[:, None] * K + cols_k[None, :],
                  mask=(t0 + block < T)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    k_before = k_j * tl.exp(G_n[None, :] - G_j)
    dq_acc += mma(tl.load(dA + cc_rows + block[None, :]), k_before, PRECISION)
    dk_acc += mma(tl.load(dP + cc_rows + block[None, :]), k_before, PRECISION)
    return dq_acc, dk_acc


@triton.jit
def _column_terms(dk_acc, j, q, k, G, dA, dP, G_m, rows, scale, b, h, t0, T, Tp, cols_k, k_ok,
                  tile_cols, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                  SUBTILE: tl.constexpr, PRECISION: tl.constexpr):
    """Block j (after the tile)'s share of the tile columns' dk, at m: dA's and dKK's [16, 16]
    blocks transposed times q_j and k_j exp(G_j - G_m) (<= 1), summed (dk and dG take only
    their sum)."""
    block = j * SUBTILE + tile_cols
    in_offs = ((b * T + t0 + block) * H + h)[:, None] * K + cols_k[None, :]
    in_mask = (t0 + block < T)[:, None] & k_ok[None, :]
    G_j = tl.load(G + ((b * Tp + t0 + block) * H + h)[:, None] * K + cols_k[None, :],
                  mask=k_ok[None, :], other=0.0)
    decay_j = tl.exp(G_j - G_m[None, :])
    q_j = tl.load(q + in_offs, mask=in_mask, other=0.0).to(tl.float32) * scale
    k_j = tl.load(k + in_offs, mask=in_mask, other=0.0).to(tl.float32)
    cc_block = ((b * Tp + t0 + block) * H + h)[:, None] * C
    dk_acc += mma(tl.trans(tl.load(dA + cc_block + rows[None, :])), q_j * decay_j, PRECISION)
    dk_acc += mma(tl.trans(tl.load(dP + cc_block + rows[None, :])), k_j * decay_j, PRECISION)
    return dk_acc


@triton.jit
def tile_products_bwd_kernel(
    q, k, G, doc, dA, dP, d_qg, mt_dw, d_kd, dq, dk, dG, d_end_parts, scale, T,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SUBTILE: tl.constexpr,
    HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """dq, dk [B,T,H,K] in their inputs' dtype and dG [B,Tp,H,K] fp32 of one tile's rows, and
    the tile's sum_r K_d dK_d, d_end_parts [B, n_chunks, C/16, H, K] fp32: the gate's backward
    adds the four to G's last row without reading k, G and dK_d again (it has no other use
    for them), and this kernel holds every factor already.

    The decayed products differentiate into a row's q and k (its row of dA_qk and dKK) and into
    a column's k (its column): one program per (16-row tile and K block, chunk, batch*head)
    takes its tile's rows against the columns before the tile (referenced at the tile's first
    row n), its tile's columns against the rows after it (referenced at the first row m after
    the tile) and the tile against itself (at n), one 16-row block of the chunk at a time (16 x
    16 blocks of dA and dKK, [16, BK] tiles), each GEMM on fp32 operands (PRECISION: tf32 for
    bf16 inputs). The blocks before and after the tile run in two pipelined loops (BLOCK_LOOPS)
    that hold three [16, BK] sums, the tile's own rows loaded after them: 168 registers a
    thread, no spill, 8 kB shared at 2 warps and 2 stages on sm_90 (bench/kda_compile.py).
    bf16 operands would fit the first two (factors <= 1), but the row and column terms of dG
    cancel in sum (the products depend on differences of G only), and their rounding then
    piles up in dg's cumsum: dt_bias's error over bf16 inputs went from 6.3e-4 to
    2.5e-2 relative RMS, over its 2e-2 bound (interpreter, rounding to bf16 as the GPU does,
    packed documents and the fused gate). With the state terms (state_scan.py's
    state_terms_bwd_kernel) and M^T dW (mt_dw, from ut_transform_bwd_kernel):
        dq = d(Gamma Q) Gamma + dA_rr k + dq_A,   dk = (M^T dW) Gamma + dK_d (gamma_C / Gamma)
             + dA_rr q + dk_A + dk_KK
        dG = its factors' share of each term (row terms +, column terms -); dg is its reverse
             cumsum within the chunk (gate_cumsum.py).
    The diagonal of A_qk (exponent 0) enters dG as +q k dA_rr and -k q dA_rr, which cancel
    exactly; through the tile GEMMs they would leave noise larger than dg itself when the gate
    is pinned at g_min, so the GEMMs take dA's strict part and the diagonal goes to dq, dk alone.
    """
    scale = tl.cast(scale, tl.float32)
    # The programs of one chunk are adjacent in launch order (tile fastest, then K block), so
    # the chunk's dA and dKK (32 kB) and its k, q, G columns are read from DRAM once and
    # hit in L2 for the other programs; chunk-fastest order put n_chunks programs between them,
    # about 50 MB of other chunks at 64K tokens, past L2.
    tile_block, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, k_block = tile_block % (C // SUBTILE), tile_block // (C // SUBTILE)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(1) * C
    ref = tile * SUBTILE
    after = ref + SUBTILE
    tile_cols = tl.arange(0, SUBTILE)
    rows = ref + tile_cols
    cols_k = k_block * BK + tl.arange(0, BK)
    k_ok = cols_k < K
    row_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    row_mask = (t0 + rows < T)[:, None] & k_ok[None, :]
    pad_rows = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    cc_rows = ((b * Tp + t0 + rows) * H + h)[:, None] * C

    # G at n, at m (the last row for the last tile: no row follows it, and its exponents stay
    # <= 0) and at the chunk's end.
    G_row = G + (b * Tp + t0) * H * K + h * K + cols_k
    G_n = tl.load(G_row + ref * H * K, mask=k_ok, other=0.0)
    G_m = tl.load(G_row + tl.minimum(after, C - 1) * H * K, mask=k_ok, other=0.0)
    G_end = tl.load(G_row + (C - 1) * H * K, mask=k_ok, other=0.0)

    # The chunk's other 16-row blocks j in two runtime loops, pipelined (BLOCK_LOOPS), where one
    # unrolled loop with a branch a block waited on each block's loads. The tile's own rows are
    # loaded after both, which then hold only three sums (240 registers at 2 warps with the
    # tile's terms computed between the loops, 168 so). First the blocks before the tile: its
    # rows' terms (at n: exp(G_n - G_j) <= 1).
    dq_before = tl.zeros((SUBTILE, BK), dtype=tl.float32)
    dk_before = tl.zeros((SUBTILE, BK), dtype=tl.float32)
    if INTERPRETED:  # see BLOCK_LOOPS
        j = 0
        while j < tile:
            dq_before, dk_before = _row_terms(dq_before, dk_before, j, k, G, dA, dP, G_n, cc_rows,
                                              b, h, t0, T, Tp, cols_k, k_ok, tile_cols, H, K,
                                              SUBTILE, PRECISION)
            j += 1
    else:
        for j in tl.range(0, tile):
            dq_before, dk_before = _row_terms(dq_before, dk_before, j, k, G, dA, dP, G_n, cc_rows,
                                              b, h, t0, T, Tp, cols_k, k_ok, tile_cols, H, K,
                                              SUBTILE, PRECISION)

    # Then the blocks after the tile: its columns' terms (at m: exp(G_j - G_m) <= 1), rescaled
    # to the tile's rows at the end.
    dk_after = tl.zeros((SUBTILE, BK), dtype=tl.float32)
    if INTERPRETED:
        j = tile + 1
        while j < C // SUBTILE:
            dk_after = _column_terms(dk_after, j, q, k, G, dA, dP, G_m, rows, scale, b, h, t0, T,
                                     Tp, cols_k, k_ok, tile_cols, H, K, C, SUBTILE, PRECISION)
            j += 1
    else:
        for j in tl.range(tile + 1, C // SUBTILE):
            dk_after = _column_terms(dk_after, j, q, k, G, dA, dP, G_m, rows, scale, b, h, t0, T,
                                     Tp, cols_k, k_ok, tile_cols, H, K, C, SUBTILE, PRECISION)

    # The tile against itself at n (dA's strict part, its diagonal apart), both ways.
    q_s = tl.load(q + row_offs, mask=row_mask, other=0.0).to(tl.float32) * scale
    k_s = tl.load(k + row_offs, mask=row_mask, other=0.0).to(tl.float32)
    G_s = tl.load(G + pad_rows, mask=k_ok[None, :], other=0.0)
    strict = tile_cols[:, None] > tile_cols[None, :]
    dA_tile = tl.load(dA + cc_rows + rows[None, :], mask=strict, other=0.0)
    dP_tile = tl.load(dP + cc_rows + rows[None, :], mask=strict, other=0.0)
    dA_diag = tl.load(dA + ((b * Tp + t0 + rows) * H + h) * C + rows)[:, None]
    row_factor = tl.exp(G_s - G_n)  # <= 1
    col_factor = tl.exp(G_n - G_s)  # <= exp(75), chunk_common.py
    k_tile = k_s * col_factor
    dq_a = row_factor * (dq_before + mma(dA_tile, k_tile, PRECISION))
    dk_row = row_factor * (dk_before + mma(dP_tile, k_tile, PRECISION))
    # dk's column terms enter dk and dG only as the sum of dA's and dKK's, so one sum is kept.
    dk_t = col_factor * (mma(tl.trans(dA_tile), q_s * row_factor, PRECISION)
                         + mma(tl.trans(dP_tile), k_s * row_factor, PRECISION))

    # The state terms.
    d_qg_s = tl.load(d_qg + pad_rows, mask=k_ok[None, :], other=0.0)
    d_kd_s = tl.load(d_kd + pad_rows, mask=k_ok[None, :], other=0.0)
    d_gk = tl.load(mt_dw + pad_rows, mask=k_ok[None, :], other=0.0)
    d, _, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    decay = tl.exp(G_s)
    to_end = tl.where((d == d_last)[:, None], tl.exp(G_end[None, :] - G_s), 0.0)
    dq_c = d_qg_s * decay + dA_diag * k_s + dq_a
    tl.store(dq + row_offs, rounded_to(dq_c * scale, dq.dtype.element_ty), mask=row_mask)
    dk_t += tl.exp(G_m[None, :] - G_s) * dk_after  # <= 1
    d_kd_end = d_kd_s * to_end
    dk_c = d_gk * decay + d_kd_end + dA_diag * q_s + dk_row + dk_t
    dG_c = (q_s * (decay * d_qg_s + dq_a)
            + k_s * (decay * d_gk - d_kd_end + dk_row - dk_t))
    tl.store(dk + row_offs, rounded_to(dk_c, dk.dtype.element_ty), mask=row_mask)
    tl.store(dG + pad_rows, dG_c, mask=k_ok[None, :])
    # The tile's share of sum_r K_d dK_d, what K_d gives G's last row (gate_cumsum.py).
    n_tiles = C // SUBTILE
    part = (((b * tl.num_programs(1) + chunk) * n_tiles + tile) * H + h) * K + cols_k
    tl.store(d_end_parts + part, tl.sum(k_s * d_kd_end, axis=0), mask=k_ok)
