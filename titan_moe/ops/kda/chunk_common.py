"""Pieces shared by the chunk kernels of KDA, in Triton (spec §3).

For a chunk of C = 64 tokens with G = cumsum(g) from the chunk start and Gamma = exp(G):
    A_qk[r,j] = sum_c q_rc k_jc exp(G_rc - G_jc)        j <= r, same document
    KK[r,j]   = sum_c k_rc k_jc exp(G_rc - G_jc)        j <  r, same document
    Tinv = (I + Diag(beta) KK)^{-1},   W = Tinv (beta * Gamma * K),   U = Tinv (beta * V)
gate_cumsum.py writes G, tile_products.py A_qk and KK by 16-row tiles, ut_transform.py Tinv, W
and U; here are the gate, the chunk's documents and the GEMM helper.

Numeric range, the reason the 16-token tiles are dense tensor-core GEMMs: with g in [-5, 0]
(the lower-bounded gate), exp(G_r - G_j) is split at the first row n of r's 16-row tile as
exp(G_r - G_n) * exp(G_n - G_j). The row factor is <= 1. The column factor is <= 1 left of the
tile and at most exp(15 * 5) = exp(75) inside it, below the exp(88) ceiling of fp32 and bf16
(same exponent range); columns right of the tile would overflow, so their exponent is zeroed
before the exp and the operand masked. Every product term is finite; the j > r triangle of the
diagonal tile is masked after the GEMM. Rounding each factored operand to bf16 costs 2^-9 of
each term, the same relative error as the bf16 q and k themselves.
"""

import triton
import triton.language as tl

# The training chunk: 64 tokens = four 16-token diagonal tiles.
CHUNK = 64
SUBTILE = 16


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: the GPU's conversion
    (cvt.rn). Triton 3.6's interpreter converts by truncation instead, whose error is twice as
    large and one-signed, so it piles up in sums (tests/ops/test_kda_triton.py checks this one
    against torch's). Finite values only: a NaN may come back as another NaN or infinity."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rounded_to(x, dtype: tl.constexpr):
    """fp32 x in dtype, rounded to nearest as the GPU converts, under the interpreter too (there
    the bound of a bf16 output would otherwise meet twice the rounding error)."""
    if dtype == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def mma(a, b, OPERAND: tl.constexpr):
    """a @ b accumulated in fp32, the operands as OPERAND says: "bf16" (tensor cores at full
    rate), "bf16_emulated" (the same rounding, then IEEE fp32 GEMMs: Triton 3.6's interpreter
    misreads bf16 dot operands and truncates to bf16), or a tl.dot input precision ("tf32",
    "ieee") on fp32 operands."""
    if OPERAND == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif OPERAND == "bf16_emulated":
        return tl.dot(round_to_bf16(a.to(tl.float32)), round_to_bf16(b.to(tl.float32)),
                      input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=OPERAND)


@triton.jit
def kda_gate_from_raw(g_raw, A_log_h, dt_bias_row, g_min):
    """g = g_min * sigmoid(exp(A_log_h) * (g_raw + dt_bias)): the lower-bounded gate."""
    return g_min * tl.sigmoid(tl.exp(A_log_h) * (g_raw + dt_bias_row[None, :]))


@triton.jit
def keys_decayed_to_end(k_c, G_c, G_end, last_doc):
    """K_d = (gamma_C / Gamma) * K on the rows of the chunk's last document, 0 on the others:
    the keys the state scans multiply by. The UT transform writes it as the scans' operand;
    tile_products_bwd_kernel takes the same factors in fp32 (k, exp(G_end - G)) for
    sum_r K_d dK_d, the gate's gradient at the chunk's end."""
    return tl.where(last_doc[:, None], k_c * tl.exp(G_end[None, :] - G_c), 0.0)


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
