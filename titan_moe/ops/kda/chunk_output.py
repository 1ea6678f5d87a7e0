"""KDA output in Triton: O = (Gamma * Q) S + A_qk V~ per chunk (spec §3).

Parallel over (chunk, batch*head), once the scan has written the state S entering each chunk
and V~; each program walks V by BV columns, so it loads Q, G and A_qk once (with one program a
V block, as before, those loads were 4x over at V = 128 and made the kernel memory-bound: 2.15
ms at 64K tokens, 16 heads on the H200 against fla's 0.49). With packed documents only the rows
continuing from the previous chunk read S (A_qk is already zero across documents). The GEMMs
take OPERAND (bf16 for half-precision inputs, fp32 accumulation; exp(G_r) <= 1). Over bf16
inputs the output's error is at most 4.3e-3 relative RMS against float64 (bound 5e-3; 4.1e-3
with the scan's V~ in two bf16 parts, 3.5e-3 with that and tf32 operands here), at a near-zero
gate, d 64, 333 tokens; 3.3-3.7e-3 on random and pinned gates, d 32-128, up to 1,000 tokens
(interpreter, GPU rounding).
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.chunk_common import chunk_documents, mma, rounded_to


@triton.jit
def query_operands(q, G, doc, b, h, t0, T, Tp, rows, cols_k, H: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The chunk's queries, fp32, zero on rows that do not continue from the previous chunk
    (only those read S), and its G: the operands of scale * Gamma * Q. Values only, as
    ut_transform.gamma_keys (Inductor's write analysis)."""
    k_ok = cols_k < K
    d, d_before, _ = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    cont = (d == d_before) & (t0 + rows < T)
    in_offs = ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    q_c = tl.load(q + in_offs, mask=cont[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
    G_c = tl.load(G + pad_offs, mask=k_ok[None, :], other=0.0)
    return q_c, G_c


@triton.jit
def chunk_output_kernel(
    q, G, A_qk, h_states, v_new, doc, o, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    """o [B,T,H,V] in o's dtype. One program a chunk and batch*head walks V by BV columns, so
    Gamma * Q and A_qk are loaded and formed once, not once a V block. The states come in the
    operand dtype (state_scan.py): S is only a GEMM operand here, so bf16 storage changes no
    value of o."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale = tl.cast(scale, tl.float32)
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    q_c, G_c = query_operands(q, G, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS)
    q_g = q_c * scale * tl.exp(G_c)
    A = tl.load(A_qk + ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :])
    state_base = ((b * n_chunks + chunk) * H + h).to(tl.int64) * K * V
    for v0 in tl.range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        S = tl.load(h_states + state_base + cols_k[:, None] * V + cols_v[None, :],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        v_c = tl.load(v_new + v_offs, mask=v_ok[None, :], other=0.0)
        out = mma(q_g, S, OPERAND) + mma(A, v_c, OPERAND)
        o_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        tl.store(o + o_offs, rounded_to(out, o.dtype.element_ty),
                 mask=valid[:, None] & v_ok[None, :])


@triton.jit
def chunk_output_bwd_kernel(
    q, G, A_qk, doc, do, dh_states, dv_new, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    """The output's gradient terms, parallel over chunks, ahead of the reverse scan:
        dh_states[c] = (Gamma * Q)^T dO    (the part of dS that comes from the chunk's output)
        dv_new[c]    = A_qk^T dO           (the part of dV~ that does not go through dS)
    Neither depends on the state gradient, so the scan (state_scan_bwd_kernel) only adds its
    recurrent terms to them, and its serial chain per chunk is two GEMMs, not four. One program
    a chunk and batch*head, V by BV columns, as chunk_output_kernel. dh_states in the operand
    dtype (rounded to nearest: state_scan.py says what bf16 costs), dv_new fp32."""
    scale = tl.cast(scale, tl.float32)  # an fp64 scalar under Inductor, see chunk_output_kernel
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    q_c, G_c = query_operands(q, G, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS)
    q_g_t = tl.trans(q_c * scale * tl.exp(G_c))
    A_t = tl.trans(tl.load(A_qk + ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :]))
    state_base = ((b * n_chunks + chunk) * H + h).to(tl.int64) * K * V
    for v0 in tl.range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        do_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        do_c = tl.load(do + do_offs, mask=valid[:, None] & v_ok[None, :], other=0.0)
        tl.store(dh_states + state_base + cols_k[:, None] * V + cols_v[None, :],
                 rounded_to(mma(q_g_t, do_c, OPERAND), dh_states.dtype.element_ty),
                 mask=k_ok[:, None] & v_ok[None, :])
        v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        tl.store(dv_new + v_offs, mma(A_t, do_c, OPERAND), mask=v_ok[None, :])
