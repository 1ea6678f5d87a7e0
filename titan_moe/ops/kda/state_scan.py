"""The inter-chunk KDA state scan in Triton, forward and reverse (spec §3).

Forward, chunk by chunk with S the state entering the chunk:
    V~ = U - W S,   S_next = Diag(gamma_C) S + K_d^T V~
Reverse, with dS the gradient of the state leaving the chunk (dS_next):
    dV~ = A_qk^T dO + K_d dS
    dS  <- Diag(gamma_C) dS + (Gamma * Q)^T dO - W^T dV~
where the output's terms A_qk^T dO and (Gamma * Q)^T dO come in from chunk_output_bwd_kernel,
computed parallel over chunks, so the serial chain is the two GEMMs with K_d and W.
with K_d = (gamma_C / Gamma) * K of the chunk's last document (ut_transform.py writes it). One
program per (V block, batch*head) walks the chunks in order, the state [K, BV] in fp32
registers; the gradients through each chunk's use of its states then run parallel over chunks
(state_terms_bwd_kernel). With packed documents only the rows of the document that continues
from the previous chunk read S, only the chunk's last document writes S_next, and the carry is
zero when that document starts inside the chunk.

The GEMMs take OPERAND (bf16 for half-precision inputs, fp32 accumulation, the state kept in
fp32 between chunks), as fla's scans; the forward's update multiplies K_d by V~ as stored, one
bf16 part, as fla's does: a second GEMM on V~'s rounding residual kept the final state's error
at 3.2e-3 against 4.0e-3 without it (the worst case below, a near-zero gate), at the cost of a
third GEMM on the serial chain of every chunk. Numeric range: only exp(G_r), exp(G_C) and
exp(G_C - G_r) appear, all <= 1 (G nonincreasing), and each GEMM rounds its fp32 operands (S, W,
K_d, V~) by 2^-9 a term. Over bf16 inputs, the op as it is, the final state's error is at most
4.0e-3 relative RMS against float64 (bound 5e-3; below 1e-5 on fp32 operands), the gradients'
at most 5.3e-3 (bound 2e-2): d_k 32-128, up to 1,000 tokens, random, pinned and near-zero gates,
under the interpreter rounding to bf16 as the GPU does (chunk_common.round_to_bf16). The
per-chunk states are indexed in int64: B·NC·H·K·V passes 2^31 from about 512K tokens at H 16,
K = V = 128.

The forward scan stores the state entering each chunk (h_states) in the operand dtype, rounded
to nearest, as fla does (bf16 for bf16 inputs: 32 KiB a chunk and head at K = V = 128, half of
fp32's, written here, read by chunk_output_kernel and state_terms_bwd_kernel, kept between
forward and backward). Its readers take it as a GEMM operand, rounded to bf16 there already,
but for the state terms' d gamma_C = sum_v S * dS (fp32 products): only d g (and the fused
gate's d A_log, d dt_bias) change, through gamma_C, which matters where the gate is near zero.
Measured under the interpreter (2026-12-05, bench/RESULTS.md): d g at a near-zero gate 4.9e-3
-> 5.1e-3 (d 64, 333 tokens) and 4.7e-3 -> 4.9e-3 (d 128, 500 tokens) of the 2e-2 bound, the
output, final state and every other gradient bit for bit as with fp32 states.

The state gradients (dh_states, the same shape) are stored in the operand dtype too, rounded to
nearest, as fla stores its dh: chunk_output_bwd_kernel writes each chunk's local part
(Gamma * Q)^T dO there, the reverse scan adds it to its running dS (fp32 registers) and stores
that chunk's dS in its place, state_terms_bwd_kernel reads dS as GEMM operands and in
d gamma_C. Unlike the states, the local part is rounded before the scan's fp32 add, so every
gradient downstream of the scan moves, not only d g (fla adds q^T dO inside its scan, exact).
Measured under the interpreter (2026-12-05, bench/RESULTS.md), fp32 -> bf16: d initial_state
grows most, by up to a third (2.5e-3 -> 3.3e-3), the chunks' rounded local parts summed; d beta
at a near-zero gate 4.8e-3 -> 5.25e-3, the worst that changes, 3.8x inside the 2e-2 bound; the
output, final state and d q bit for bit. Keeping the local part exact would take a second fp32
buffer (more bytes than fp32 dh_states) or its GEMM and its q, G, dO loads in the scan's loop.
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.chunk_common import chunk_documents, mma, rounded_to

# SCAN_LOOPS: compiled, the scans walk the chunks in a `for` loop, which Triton's pipeliner
# turns into prefetches: chunk c + 1's operands load while chunk c's GEMMs run (a `while` loop
# compiles to no asynchronous copy), STAGES deep (the loop's own count: the launch's num_stages
# left the reverse scan unpipelined on sm_90). On the H200 that took only 4% off the forward scan
# (2026-12-05): a chunk's 5 µs go to the serial GEMM chain on fp32 operands, not to loads.
# Triton 3.6's interpreter holds scalars as 1-element arrays, which range() cannot take under
# NumPy 2, so interpreted (INTERPRETED) the scans keep the while loop; both call the same body.


@triton.jit
def chunk_scan_operands(K_d, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H: tl.constexpr,
                        K: tl.constexpr, C: tl.constexpr, HAS_DOCS: tl.constexpr):
    """(K_d, W, carry gamma_C or 0, the rows continuing from the previous chunk: only they
    read S, so the scans zero W S's other rows, or dV~'s before W^T dV~).

    W's load takes no row mask: a mask from the document ids would make the asynchronous copy
    of W wait for their load, one more global-memory round trip on every chunk's serial chain;
    the ids are needed only after the first GEMM. W is finite on every row (ut_transform.py
    writes all Tp), so the masked rows' products are dropped, not NaN."""
    k_ok = cols_k < K
    pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    G_end = tl.load(G + ((b * Tp + t0 + C - 1) * H + h) * K + cols_k, mask=k_ok, other=0.0)
    d, d_before, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    W_c = tl.load(W + pad_offs, mask=k_ok[None, :], other=0.0)
    k_d = tl.load(K_d + pad_offs, mask=k_ok[None, :], other=0.0)
    carry = tl.where(d_last == d_before, tl.exp(G_end), 0.0)
    return k_d, W_c, carry, d == d_before


@triton.jit
def scan_fwd_chunk(S, c, K_d, G, W, U, doc, h_states, v_new, b, h, T, Tp, n_chunks, rows, cols_k,
                   cols_v, state_offs, state_ok, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, HAS_DOCS: tl.constexpr,
                   OPERAND: tl.constexpr):
    """Chunk c of the forward scan: stores the state entering it and V~, returns S_next."""
    t0 = c * C
    v_ok = cols_v < V
    k_d, W_c, carry, cont = chunk_scan_operands(
        K_d, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS
    )
    v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    U_c = tl.load(U + v_offs, mask=v_ok[None, :], other=0.0)
    state_base = ((b * n_chunks + c) * H + h).to(tl.int64) * K * V
    tl.store(h_states + state_base + state_offs, rounded_to(S, h_states.dtype.element_ty),
             mask=state_ok)
    v_c = U_c - tl.where(cont[:, None], mma(W_c, S, OPERAND), 0.0)
    v_stored = rounded_to(v_c, v_new.dtype.element_ty)
    tl.store(v_new + v_offs, v_stored, mask=v_ok[None, :])
    return carry[:, None] * S + mma(tl.trans(k_d), v_stored, OPERAND)


@triton.jit
def state_scan_fwd_kernel(
    K_d, G, W, U, doc, initial_state, h_states, v_new, final_state, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_INITIAL: tl.constexpr,
    STORE_FINAL: tl.constexpr, OPERAND: tl.constexpr, INTERPRETED: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """h_states [B,NC,H,K,V] (state entering each chunk) and v_new [B,Tp,H,V] in the operand
    dtype, final [B,H,K,V] fp32."""
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
    if INTERPRETED:  # see SCAN_LOOPS
        c = 0
        while c < n_chunks:
            S = scan_fwd_chunk(S, c, K_d, G, W, U, doc, h_states, v_new, b, h, T, Tp, n_chunks,
                               rows, cols_k, cols_v, state_offs, state_ok, H, K, V, C, HAS_DOCS,
                               OPERAND)
            c += 1
    else:
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            S = scan_fwd_chunk(S, c, K_d, G, W, U, doc, h_states, v_new, b, h, T, Tp, n_chunks,
                               rows, cols_k, cols_v, state_offs, state_ok, H, K, V, C, HAS_DOCS,
                               OPERAND)
    if STORE_FINAL:
        tl.store(final_state + bh * K * V + state_offs, S, mask=state_ok)


@triton.jit
def scan_bwd_chunk(dS, c, K_d, G, W, doc, dh_states, dv_new, b, h, T, Tp, n_chunks, rows,
                   cols_k, cols_v, state_offs, state_ok, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, HAS_DOCS: tl.constexpr,
                   OPERAND: tl.constexpr):
    """Chunk c of the reverse scan, on the output's terms that chunk_output_bwd_kernel left in
    dh_states[c] and dv_new[c]: stores dS_next of the chunk and dV~ in their place, returns the
    gradient of the state entering the chunk."""
    t0 = c * C
    v_ok = cols_v < V
    k_d, W_c, carry, cont = chunk_scan_operands(
        K_d, G, W, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS
    )
    state_addr = dh_states + ((b * n_chunks + c) * H + h).to(tl.int64) * K * V + state_offs
    dS_out = tl.load(state_addr, mask=state_ok, other=0.0).to(tl.float32)
    v_addr = dv_new + ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    dv_out = tl.load(v_addr, mask=v_ok[None, :], other=0.0)
    tl.store(state_addr, rounded_to(dS, dh_states.dtype.element_ty), mask=state_ok)
    dv_c = dv_out + mma(k_d, dS, OPERAND)
    tl.store(v_addr, dv_c, mask=v_ok[None, :])
    dv_cont = tl.where(cont[:, None], dv_c, 0.0)
    return carry[:, None] * dS + dS_out - mma(tl.trans(W_c), dv_cont, OPERAND)


@triton.jit
def state_scan_bwd_kernel(
    K_d, G, W, doc, d_final, dh_states, dv_new, d_initial, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_D_FINAL: tl.constexpr,
    STORE_D_INITIAL: tl.constexpr, OPERAND: tl.constexpr, INTERPRETED: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """dh_states [B,NC,H,K,V] (gradient of each chunk's S_next, the operand dtype), dv_new
    [B,Tp,H,V] fp32, dS_0 fp32; both buffers hold chunk_output_bwd_kernel's terms on entry. The
    running dS stays fp32 in registers; each chunk's is stored rounded to nearest."""
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
    if INTERPRETED:  # see SCAN_LOOPS
        c = n_chunks - 1
        while c >= 0:
            dS = scan_bwd_chunk(dS, c, K_d, G, W, doc, dh_states, dv_new, b, h, T, Tp, n_chunks,
                                rows, cols_k, cols_v, state_offs, state_ok, H, K, V, C, HAS_DOCS,
                                OPERAND)
            c -= 1
    else:
        for i in tl.range(0, n_chunks, num_stages=STAGES):
            dS = scan_bwd_chunk(dS, n_chunks - 1 - i, K_d, G, W, doc, dh_states, dv_new, b, h,
                                T, Tp, n_chunks, rows, cols_k, cols_v, state_offs, state_ok, H,
                                K, V, C, HAS_DOCS, OPERAND)
    if STORE_D_INITIAL:
        tl.store(d_initial + bh * K * V + state_offs, dS, mask=state_ok)


@triton.jit
def state_terms_bwd_kernel(
    do, v_new, dv_new, h_states, dh_states, doc, d_qg, d_w, d_kd, d_gamma, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    """The gradients through each chunk's use of its states, parallel over chunks and K blocks.

    With S entering the chunk (h) and dS the gradient of the state leaving it (dh):
        d(Gamma Q) = dO S^T,  dW = -dV~ S^T   (rows continuing from the previous chunk)
        dK_d = V~ dS^T,       d gamma_C = sum_v S * dS
    d_qg, d_w, d_kd [B,Tp,H,K] and d_gamma [B,NC,H,K], fp32; S and dS as stored (the operand
    dtype).

    The K blocks of a chunk are the grid's first axis, so they run side by side: each reads the
    chunk's whole dO, V~ and dV~, and the K blocks after the first find them in L2. With the
    chunk first, a chunk's K blocks would run NC programs apart, and at 64K tokens a head's dO,
    V~ and dV~ (64 MB) would pass through the H100's and H200's 50 MB L2 between them.
    """
    k_block, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(1)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = k_block * BK + tl.arange(0, BK)
    k_ok = cols_k < K
    d_qg_c = tl.zeros((C, BK), dtype=tl.float32)
    d_w_c = tl.zeros((C, BK), dtype=tl.float32)
    d_kd_c = tl.zeros((C, BK), dtype=tl.float32)
    d_gamma_c = tl.zeros((BK,), dtype=tl.float32)
    state_base = ((b * n_chunks + chunk) * H + h).to(tl.int64) * K * V
    for v0 in tl.range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        s_offs = state_base + cols_k[:, None] * V + cols_v[None, :]
        s_ok = k_ok[:, None] & v_ok[None, :]
        # fp32 for d gamma_C's products (the states and their gradients may be stored in bf16)
        S = tl.load(h_states + s_offs, mask=s_ok, other=0.0).to(tl.float32)
        dS = tl.load(dh_states + s_offs, mask=s_ok, other=0.0).to(tl.float32)
        do_c = tl.load(do + ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :],
                       mask=valid[:, None] & v_ok[None, :], other=0.0)
        pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        vn = tl.load(v_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dvn = tl.load(dv_new + pad_offs, mask=v_ok[None, :], other=0.0)
        d_qg_c += mma(do_c, tl.trans(S), OPERAND)
        d_w_c -= mma(dvn, tl.trans(S), OPERAND)
        d_kd_c += mma(vn, tl.trans(dS), OPERAND)
        d_gamma_c += tl.sum(S * dS, axis=1)
    d, d_before, _ = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    cont = (d == d_before)[:, None]
    out = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    tl.store(d_qg + out, tl.where(cont, d_qg_c, 0.0), mask=k_ok[None, :])
    tl.store(d_w + out, tl.where(cont, d_w_c, 0.0), mask=k_ok[None, :])
    tl.store(d_kd + out, d_kd_c, mask=k_ok[None, :])
    tl.store(d_gamma + ((b * n_chunks + chunk) * H + h) * K + cols_k, d_gamma_c, mask=k_ok)
