"""The inter-chunk KDA state scan in Triton, forward and reverse (spec §3).

Forward, chunk by chunk with S the state entering the chunk:
    V~ = U - W S,   S_next = Diag(gamma_C) S + ((gamma_C / Gamma) * K)^T V~
Reverse, with dS the gradient of the state leaving the chunk (dS_next):
    dV~ = A_qk^T dO + ((gamma_C / Gamma) * K) dS
    dS  <- Diag(gamma_C) dS + (Gamma * Q)^T dO - W^T dV~
One program per (V block, batch*head) walks the chunks in order, the state [K, BV] in
registers; every other piece of KDA is parallel over chunks. With packed documents only the
rows of the document that continues from the previous chunk read S, only the chunk's last
document writes S_next, and the carry is zero when that document starts inside the chunk.

Numeric range: only exp(G_r), exp(G_C) and exp(G_C - G_r) appear, all <= 1 (G nonincreasing).
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.intra_chunk import chunk_documents


@triton.jit
def chunk_scan_operands(k, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H: tl.constexpr,
                        K: tl.constexpr, C: tl.constexpr, HAS_DOCS: tl.constexpr):
    """(G, (gamma_C / Gamma) * K of the last document, W of the continuing rows, carry, cont)."""
    k_ok = cols_k < K
    valid = t0 + rows < T
    pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    G_c = tl.load(G + pad_offs, mask=k_ok[None, :], other=0.0)
    G_end = tl.sum(tl.where(rows[:, None] == C - 1, G_c, 0.0), axis=0)
    k_c = tl.load(k + in_offs, mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    d, d_before, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    cont = d == d_before
    W_c = tl.load(W + pad_offs, mask=cont[:, None] & k_ok[None, :], other=0.0)
    k_to_end = tl.where((d == d_last)[:, None], k_c * tl.exp(G_end[None, :] - G_c), 0.0)
    carry = tl.where(d_last == d_before, tl.exp(G_end), 0.0)
    return G_c, k_to_end, W_c, carry, cont


@triton.jit
def state_scan_fwd_kernel(
    k, G, W, U, doc, initial_state, h_states, v_new, final_state, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_INITIAL: tl.constexpr,
    STORE_FINAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """h_states [B,NC,H,K,V] (state entering each chunk), v_new [B,Tp,H,V], final [B,H,K,V]."""
    v_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n_chunks = tl.cdiv(T, C)
    Tp = n_chunks * C
    rows = tl.arange(0, C)
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_ok, v_ok = cols_k < K, cols_v < V
    state_offs = cols_k[:, None] * V + cols_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_INITIAL:
        S = tl.load(initial_state + bh * K * V + state_offs, mask=state_ok, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    # A while loop: Triton 3.6's interpreter cannot take a runtime range() bound under NumPy 2.
    c = 0
    while c < n_chunks:
        t0 = c * C
        _, k_to_end, W_c, carry, _ = chunk_scan_operands(
            k, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS
        )
        v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        U_c = tl.load(U + v_offs, mask=v_ok[None, :], other=0.0)
        tl.store(h_states + ((b * n_chunks + c) * H + h) * K * V + state_offs, S, mask=state_ok)
        v_c = U_c - tl.dot(W_c, S, input_precision=PRECISION)
        tl.store(v_new + v_offs, v_c, mask=v_ok[None, :])
        S = carry[:, None] * S + tl.dot(tl.trans(k_to_end), v_c, input_precision=PRECISION)
        c += 1
    if STORE_FINAL:
        tl.store(final_state + bh * K * V + state_offs, S, mask=state_ok)


@triton.jit
def state_scan_bwd_kernel(
    q, k, G, W, A_qk, doc, do, d_final, dh_states, dv_new, d_initial, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_D_FINAL: tl.constexpr,
    STORE_D_INITIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dh_states [B,NC,H,K,V] (gradient of each chunk's S_next), dv_new [B,Tp,H,V], dS_0."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale = tl.cast(scale, tl.float32)
    v_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n_chunks = tl.cdiv(T, C)
    Tp = n_chunks * C
    rows = tl.arange(0, C)
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_ok, v_ok = cols_k < K, cols_v < V
    state_offs = cols_k[:, None] * V + cols_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_D_FINAL:
        dS = tl.load(d_final + bh * K * V + state_offs, mask=state_ok, other=0.0)
    else:
        dS = tl.zeros((BK, BV), dtype=tl.float32)
    c = n_chunks - 1
    while c >= 0:
        t0 = c * C
        valid = t0 + rows < T
        G_c, k_to_end, W_c, carry, cont = chunk_scan_operands(
            k, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS
        )
        in_offs_k = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        q_c = tl.load(q + in_offs_k, mask=(valid & cont)[:, None] & k_ok[None, :], other=0.0)
        q_decayed = q_c.to(tl.float32) * scale * tl.exp(G_c)
        A = tl.load(A_qk + ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :])
        do_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        do_c = tl.load(do + do_offs, mask=valid[:, None] & v_ok[None, :], other=0.0)
        do_c = do_c.to(tl.float32)
        tl.store(dh_states + ((b * n_chunks + c) * H + h) * K * V + state_offs, dS,
                 mask=state_ok)
        dv_c = tl.dot(tl.trans(A), do_c, input_precision=PRECISION)
        dv_c += tl.dot(k_to_end, dS, input_precision=PRECISION)
        v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        tl.store(dv_new + v_offs, dv_c, mask=v_ok[None, :])
        dS = carry[:, None] * dS + tl.dot(tl.trans(q_decayed), do_c, input_precision=PRECISION)
        dS -= tl.dot(tl.trans(W_c), dv_c, input_precision=PRECISION)
        c -= 1
    if STORE_D_INITIAL:
        tl.store(d_initial + bh * K * V + state_offs, dS, mask=state_ok)
