"""The UT transform of one chunk, in Triton: W, U and the keys decayed to its end (§3).

    M = Tinv Diag(beta),   W = M (Gamma * K),   U = M V
    K_d = (gamma_C / Gamma) * K on the rows of the chunk's last document, 0 on the others
One program per (chunk, batch*head), from Tinv and G (unit_lower_inverse.py, gate_cumsum.py).
K_d is what the state scans multiply by (state_scan.py), written here so the sequential scans
load it instead of computing it. W and U are GEMMs on OPERAND operands. Numeric range: Tinv's
entries stay below 2^63 (unit_lower_inverse.py), inside bf16's exponent range; Gamma and
gamma_C / Gamma are <= 1.
"""

import triton
import triton.language as tl

from titan_moe.ops.kda.chunk_common import (
    chunk_documents,
    keys_decayed_to_end,
    mma,
    rounded_to,
)


@triton.jit
def gamma_keys(k, G, b, h, t0, T, Tp, rows, cols_k, H: tl.constexpr, K: tl.constexpr):
    """(K, G, Gamma * K) of the chunk's rows in the K block cols_k, fp32. It returns values
    only: Inductor's analysis of what a kernel writes counts the pointers a helper takes as
    written when the helper also returns offsets."""
    k_ok = cols_k < K
    k_c = tl.load(k + ((b * T + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                  mask=(t0 + rows < T)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    G_c = tl.load(G + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                  mask=k_ok[None, :], other=0.0)
    return k_c, G_c, k_c * tl.exp(G_c)


@triton.jit
def ut_transform_kernel(
    k, v, G, beta, doc, Tinv, W, U, K_d, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr,
):  # fmt: skip
    """W, K_d [B,Tp,H,K] in the scans' operand dtype, U [B,Tp,H,V] fp32."""
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(0) * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    beta_c = tl.load(beta + (b * T + t0 + rows) * H + h, mask=valid, other=0.0).to(tl.float32)
    cc_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :]
    M = tl.load(Tinv + cc_offs) * beta_c[None, :]
    d, _, d_last = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    last_doc = d == d_last
    for k0 in tl.range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        k_ok = cols_k < K
        k_c, G_c, k_gamma = gamma_keys(k, G, b, h, t0, T, Tp, rows, cols_k, H, K)
        out_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        tl.store(W + out_offs, rounded_to(mma(M, k_gamma, OPERAND), W.dtype.element_ty),
                 mask=k_ok[None, :])
        G_end = tl.load(G + ((b * Tp + t0 + C - 1) * H + h) * K + cols_k, mask=k_ok, other=0.0)
        k_d = keys_decayed_to_end(k_c, G_c, G_end, last_doc)
        tl.store(K_d + out_offs, rounded_to(k_d, K_d.dtype.element_ty), mask=k_ok[None, :])
    for v0 in tl.range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        v_c = tl.load(v + ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :],
                      mask=valid[:, None] & v_ok[None, :], other=0.0)
        v_out = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        tl.store(U + v_out, mma(M, v_c, OPERAND), mask=v_ok[None, :])


@triton.jit
def ut_transform_bwd_kernel(
    k, v, G, beta, doc, KK, Tinv, v_new, dv_new, do, d_w, dv, dbeta, dA, dP, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_DOCS: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The UT transform's backward: dv, dbeta, the gradients of the decayed products, and M^T dW
    in place of dW.

        dA_qk = dO V~^T (causal, same document),   dM = dW (Gamma K)^T + dV~ V^T,   dV = M^T dV~
        M = Tinv Diag(beta):  dbeta_j += sum_r dM_rj Tinv_rj,   dTinv = dM Diag(beta)
        Tinv = (I + L)^{-1}:  dL = -Tinv^T dTinv Tinv^T (strict lower, same document)
        L = Diag(beta) KK:    dbeta_r += sum_j dL_rj KK_rj,     dKK = Diag(beta) dL
    dv [B,T,H,V] in v's dtype, dbeta [B,T,H] fp32, dA (strict part and diagonal) and dP = dKK
    [B,Tp,H,C] fp32. One program per (chunk, batch*head), every GEMM on OPERAND operands (bf16
    for half-precision inputs; Tinv's range is the forward's): over bf16 inputs, the op as it
    is, the gradients' error is at most 5.2e-3 relative RMS against float64 (bound 2e-2;
    interpreter, rounding as the GPU does).
    M^T dW = Diag(beta) Tinv^T dW (written over d_w, fp32, its GEMM on PRECISION operands for
    the reason tile_products_bwd_kernel's docstring gives: dG's terms cancel) is dk's and dG's
    term through W: this program holds Tinv and reads dW already, where each of
    tile_products_bwd_kernel's 16 programs of a chunk reloaded 16-row blocks of both for
    16 x 16 GEMMs.
    """
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(0) * C
    rows = tl.arange(0, C)
    valid = t0 + rows < T
    d, _, _ = chunk_documents(doc, b, t0, rows, T, C, HAS_DOCS)
    same_doc = d[:, None] == d[None, :]
    strict = (rows[:, None] > rows[None, :]) & same_doc
    diagonal = rows[:, None] == rows[None, :]
    cc_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * C + rows[None, :]
    inv = tl.load(Tinv + cc_offs)
    beta_c = tl.load(beta + (b * T + t0 + rows) * H + h, mask=valid, other=0.0).to(tl.float32)
    M = inv * beta_c[None, :]
    dA_c = tl.zeros((C, C), dtype=tl.float32)
    dM = tl.zeros((C, C), dtype=tl.float32)
    for v0 in tl.range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        in_offs = ((b * T + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        in_mask = valid[:, None] & v_ok[None, :]
        pad_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * V + cols_v[None, :]
        do_c = tl.load(do + in_offs, mask=in_mask, other=0.0)
        v_c = tl.load(v + in_offs, mask=in_mask, other=0.0)
        vn = tl.load(v_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dvn = tl.load(dv_new + pad_offs, mask=v_ok[None, :], other=0.0)
        dA_c += mma(do_c, tl.trans(vn), OPERAND)
        dM += mma(dvn, tl.trans(v_c), OPERAND)
        tl.store(dv + in_offs, rounded_to(mma(tl.trans(M), dvn, OPERAND), dv.dtype.element_ty),
                 mask=in_mask)
    for k0 in tl.range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        k_gamma = gamma_keys(k, G, b, h, t0, T, Tp, rows, cols_k, H, K)[2]
        d_w_c = tl.load(d_w + ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :],
                        mask=(cols_k < K)[None, :], other=0.0)
        dM += mma(d_w_c, tl.trans(k_gamma), OPERAND)
    dbeta_c = tl.sum(dM * inv, axis=0)
    dL = -mma(mma(tl.trans(inv), dM * beta_c[None, :], OPERAND), tl.trans(inv), OPERAND)
    dL = tl.where(strict, dL, 0.0)
    dbeta_c += tl.sum(dL * tl.load(KK + cc_offs), axis=1)
    tl.store(dbeta + (b * T + t0 + rows) * H + h, dbeta_c, mask=valid)
    tl.store(dA + cc_offs, tl.where(strict | diagonal, dA_c, 0.0))
    tl.store(dP + cc_offs, dL * beta_c[:, None])
    # M^T dW last, when dM and dL are dead (in the loop above: 64 B of spills on sm_90).
    for k0 in tl.range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        w_offs = ((b * Tp + t0 + rows) * H + h)[:, None] * K + cols_k[None, :]
        d_w_c = tl.load(d_w + w_offs, mask=(cols_k < K)[None, :], other=0.0)
        tl.store(d_w + w_offs, beta_c[:, None] * mma(tl.trans(inv), d_w_c, PRECISION),
                 mask=(cols_k < K)[None, :])
