"""KDA output in Triton: O = (Gamma * Q) S + A_qk V~ per chunk (spec §3).

Parallel over (chunk, V block, batch*head), once the scan has written the state S entering
each chunk and V~. With packed documents only the rows continuing from the previous chunk read
S (A_qk is already zero across documents). The GEMMs take OPERAND: fp32 operands (tf32 for
half-precision inputs; exp(G_r) <= 1). On bf16 operands the output's error over bf16 inputs
rose from 3.5e-3 to 4.3e-3 relative RMS against float64 at a near-zero gate (d 64, 333 tokens,
interpreter; bound 5e-3), too close to its bound for the 0.4 ms both kernels take.
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
    """o [B,T,H,V] in o's dtype."""
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, they
    # promote what they multiply to fp64 and tl.dot rejects the mixed operands.
    scale = tl.cast(scale, tl.float32)
    chunk, v_block, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_ok, v_ok = cols_k < K, cols_v < V
    q_c, G_c = query_operands(q, G, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS)
    state_base = ((b * n_chunks + chunk) * H + h).to(tl.int64) * K * V
    S = tl.load(h_states + state_base + cols_k[:, None] * V + cols_v[None, :],
                mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    A = tl.load(A_qk + ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :])
    v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    v_c = tl.load(v_new + v_offs, mask=v_ok[None, :], other=0.0)
    out = mma(q_c * scale * tl.exp(G_c), S, OPERAND) + mma(A, v_c, OPERAND)
    o_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    tl.store(o + o_offs, rounded_to(out, o.dtype.element_ty), mask=valid[:, None] & v_ok[None, :])


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
    recurrent terms to them, and its serial chain per chunk is two GEMMs, not four."""
    scale = tl.cast(scale, tl.float32)  # an fp64 scalar under Inductor, see chunk_output_kernel
    chunk, v_block, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    n_chunks = tl.num_programs(0)
    Tp = n_chunks * C
    t0 = chunk * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_ok, v_ok = cols_k < K, cols_v < V
    q_c, G_c = query_operands(q, G, doc, b, h, t0, T, Tp, rows, cols_k, H, K, C, HAS_DOCS)
    A = tl.load(A_qk + ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :])
    do_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    do_c = tl.load(do + do_offs, mask=valid[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    dS_out = mma(tl.trans(q_c * scale * tl.exp(G_c)), do_c, OPERAND)
    state_base = ((b * n_chunks + chunk) * H + h).to(tl.int64) * K * V
    tl.store(dh_states + state_base + cols_k[:, None] * V + cols_v[None, :], dS_out,
             mask=k_ok[:, None] & v_ok[None, :])
    v_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
    tl.store(dv_new + v_offs, mma(tl.trans(A), do_c, OPERAND), mask=v_ok[None, :])
