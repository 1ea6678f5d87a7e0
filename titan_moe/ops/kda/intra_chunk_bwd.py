"""KDA backward within one chunk, in Triton, given the scan's states and their gradients.

With S the state entering the chunk (h), dS its leaving gradient (dh), V~ and dV~ from the scans:
    d(Gamma Q) = dO S^T (continuing rows)      dA_qk = dO V~^T (causal, same document)
    dW = -dV~ S^T (continuing rows)            dK_d  = V~ dS^T (last document)
    dM = dW (Gamma K)^T + dV~ V^T              d(Gamma K) = M^T dW,   dV = M^T dV~
    M = Tinv Diag(beta):  dbeta_j += sum_r dM_rj Tinv_rj,   dTinv = dM Diag(beta)
    Tinv = (I + L)^{-1}:  dL = -Tinv^T dTinv Tinv^T (strict lower, same document)
    L = Diag(beta) KK:    dbeta_r += sum_j dL_rj KK_rj,     dKK = Diag(beta) dL
with K_d = (gamma_C / Gamma) K; the decayed products A_qk, KK differentiate into q, k and G
with the same 16-row tile references as the forward (intra_chunk.py gives the numeric range).
dg is the reverse cumsum of dG within the chunk, gamma_C's gradient landing on the last row.
One program per (chunk, batch*head); the C x C matrices stay in registers, K goes in blocks.
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.intra_chunk import chunk_documents, tile_decay_factors


@triton.jit
def state_gradients(do, v_new, dv_new, h_states, dh_states, b, h, chunk, t0, T, Tp, n_chunks,
                    rows, cols_k, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BKB: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                    PRECISION: tl.constexpr):
    """dO S^T, -dV~ S^T, V~ dS^T [C, BKB] and sum_v S dS [BKB] for the K block cols_k."""
    valid = t0 + rows < T
    k_ok = cols_k < K
    d_qg = tl.zeros((C, BKB), dtype=tl.float32)
    d_w = tl.zeros((C, BKB), dtype=tl.float32)
    d_kd = tl.zeros((C, BKB), dtype=tl.float32)
    d_gamma = tl.zeros((BKB,), dtype=tl.float32)
    state_base = ((b * n_chunks + chunk) * H + h) * K * V
    for v0 in tl.static_range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        s_offs = state_base + cols_k[:, None] * V + cols_v[None, :]
        s_ok = k_ok[:, None] & v_ok[None, :]
        S = tl.load(h_states + s_offs, mask=s_ok, other=0.0)
        dS = tl.load(dh_states + s_offs, mask=s_ok, other=0.0)
        do_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        do_c = tl.load(do + do_offs, mask=valid[:, None] & v_ok[None, :], other=0.0)
        pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        vn = tl.load(v_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dvn = tl.load(dv_new + pad_offs, mask=v_ok[None, :], other=0.0)
        d_qg += tl.dot(do_c.to(tl.float32), tl.trans(S), input_precision=PRECISION)
        d_w -= tl.dot(dvn, tl.trans(S), input_precision=PRECISION)
        d_kd += tl.dot(vn, tl.trans(dS), input_precision=PRECISION)
        d_gamma += tl.sum(S * dS, axis=1)
    return d_qg, d_w, d_kd, d_gamma


@triton.jit
def intra_chunk_bwd_kernel(
    q, k, v, g, beta, doc, A_log, dt_bias, G, KK, Tinv, h_states, dh_states, v_new, dv_new, do,
    dq, dk, dv, dg, dbeta, scale, g_min, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, SUBTILE: tl.constexpr, HAS_DOCS: tl.constexpr, FUSED_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq, dk, dv, dg (of g_raw with FUSED_GATE), dbeta, all [B,T,H,*] in their input's dtype."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale, g_min = tl.cast(scale, tl.float32), tl.cast(g_min, tl.float32)
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    d, d_before, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    cont = d == d_before
    last = d == d_last
    same_doc = d[:, None] == d[None, :]
    strict = (rows[:, None] > rows[None, :]) & same_doc

    cc_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :]
    inv = tl.load(Tinv + cc_offs)
    P = tl.load(KK + cc_offs)
    beta_c = tl.load(beta + (b * T + t0 + rows) * H + h, mask=valid, other=0.0).to(tl.float32)
    M = inv * beta_c[None, :]

    dA = tl.zeros((C, C), dtype=tl.float32)
    dM = tl.zeros((C, C), dtype=tl.float32)
    for v0 in tl.static_range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        in_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        in_mask = valid[:, None] & v_ok[None, :]
        pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        do_c = tl.load(do + in_offs, mask=in_mask, other=0.0).to(tl.float32)
        v_c = tl.load(v + in_offs, mask=in_mask, other=0.0).to(tl.float32)
        vn = tl.load(v_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dvn = tl.load(dv_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dA += tl.dot(do_c, tl.trans(vn), input_precision=PRECISION)
        dM += tl.dot(dvn, tl.trans(v_c), input_precision=PRECISION)
        dv_c = tl.dot(tl.trans(M), dvn, input_precision=PRECISION)
        tl.store(dv + in_offs, dv_c.to(dv.dtype.element_ty), mask=in_mask)
    dA_diag = tl.sum(tl.where(rows[:, None] == rows[None, :], dA, 0.0), axis=1)
    dA = tl.where(strict, dA, 0.0)

    for k0 in tl.range(0, K, BKB, num_stages=1):
        cols_k = k0 + tl.arange(0, BKB)
        k_ok = cols_k < K
        _, d_w, _, _ = state_gradients(do, v_new, dv_new, h_states, dh_states, b, h, chunk, t0,
                                       T, Tp, n_chunks, rows, cols_k, H, K, V, BKB, BV, C,
                                       PRECISION)
        in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        k_c = tl.load(k + in_offs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        G_c = tl.load(G + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                      mask=k_ok[None, :], other=0.0)
        d_w = tl.where(cont[:, None], d_w, 0.0)
        dM += tl.dot(d_w, tl.trans(k_c.to(tl.float32) * tl.exp(G_c)), input_precision=PRECISION)

    dbeta_c = tl.sum(dM * inv, axis=0)
    dT = dM * beta_c[None, :]
    dL = -tl.dot(tl.dot(tl.trans(inv), dT, input_precision=PRECISION), tl.trans(inv),
                 input_precision=PRECISION)
    dL = tl.where(strict, dL, 0.0)
    dbeta_c += tl.sum(dL * P, axis=1)
    dP = dL * beta_c[:, None]
    tl.store(dbeta + (b * T + t0 + rows) * H + h, dbeta_c.to(dbeta.dtype.element_ty),
             mask=valid)

    carry_ok = d_last == d_before
    if FUSED_GATE:
        A_log_h = tl.load(A_log + h).to(tl.float32)
    for k0 in tl.range(0, K, BKB, num_stages=1):
        cols_k = k0 + tl.arange(0, BKB)
        k_ok = cols_k < K
        d_qg, d_w, d_kd, d_gamma = state_gradients(
            do, v_new, dv_new, h_states, dh_states, b, h, chunk, t0, T, Tp, n_chunks, rows,
            cols_k, H, K, V, BKB, BV, C, PRECISION,
        )
        in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        in_mask = valid[:, None] & k_ok[None, :]
        q_c = tl.load(q + in_offs, mask=in_mask, other=0.0).to(tl.float32) * scale
        k_c = tl.load(k + in_offs, mask=in_mask, other=0.0).to(tl.float32)
        G_c = tl.load(G + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                      mask=k_ok[None, :], other=0.0)
        G_end = tl.sum(tl.where(rows[:, None] == C - 1, G_c, 0.0), axis=0)
        d_qg = tl.where(cont[:, None], d_qg, 0.0)
        d_w = tl.where(cont[:, None], d_w, 0.0)
        to_end = tl.where(last[:, None], tl.exp(G_end[None, :] - G_c), 0.0)
        decay = tl.exp(G_c)
        d_gk = tl.dot(tl.trans(M), d_w, input_precision=PRECISION)
        k_to_end = k_c * to_end
        dq_c = d_qg * decay
        dk_c = d_gk * decay + d_kd * to_end
        dG = q_c * decay * d_qg + k_c * decay * d_gk - k_to_end * d_kd
        dG_end = tl.sum(k_to_end * d_kd, axis=0) + tl.where(carry_ok, tl.exp(G_end) * d_gamma,
                                                            0.0)
        # The diagonal of A_qk (exponent 0) enters dG as +q k dA_rr and -k q dA_rr, which cancel
        # exactly; computed through the tf32 tile GEMMs they would leave noise larger than dg
        # itself when the gate is pinned at g_min. So the GEMMs take dA's strict part and the
        # diagonal goes to dq, dk alone, in fp32.
        dq_c += dA_diag[:, None] * k_c
        dk_c += dA_diag[:, None] * q_c
        for i in tl.range(0, C // SUBTILE, num_stages=1):
            row_factor, col_factor = tile_decay_factors(G_c, rows, i, SUBTILE)
            dq_a = row_factor * tl.dot(dA, k_c * col_factor, input_precision=PRECISION)
            dk_a = col_factor * tl.dot(tl.trans(dA), q_c * row_factor, input_precision=PRECISION)
            dk_row = row_factor * tl.dot(dP, k_c * col_factor, input_precision=PRECISION)
            dk_col = col_factor * tl.dot(tl.trans(dP), k_c * row_factor,
                                         input_precision=PRECISION)
            dq_c += dq_a
            dk_c += dk_a + dk_row + dk_col
            dG += q_c * dq_a - k_c * dk_a + k_c * dk_row - k_c * dk_col
        dG += tl.where(rows[:, None] == C - 1, dG_end[None, :], 0.0)
        dg_c = tl.cumsum(dG, axis=0, reverse=True)
        if FUSED_GATE:
            g_raw = tl.load(g + in_offs, mask=in_mask, other=0.0).to(tl.float32)
            dt_row = tl.load(dt_bias + h * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
            gate = tl.sigmoid(tl.exp(A_log_h) * (g_raw + dt_row[None, :]))
            dg_c = dg_c * g_min * gate * (1.0 - gate) * tl.exp(A_log_h)
        tl.store(dq + in_offs, (dq_c * scale).to(dq.dtype.element_ty), mask=in_mask)
        tl.store(dk + in_offs, dk_c.to(dk.dtype.element_ty), mask=in_mask)
        tl.store(dg + in_offs, dg_c.to(dg.dtype.element_ty), mask=in_mask)
