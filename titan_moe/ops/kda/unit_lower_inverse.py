"""The UT transform's inverse of one chunk, in Triton, by 16 x 16 blocks (spec §3).

    Tinv = (I + L)^{-1},   L = Diag(beta) KK  (strictly lower, zero across documents)
With L and Tinv cut into 4 x 4 blocks of 16 rows, each diagonal block D_i = (I + L_ii)^{-1} by
doubling, and the blocks below the diagonal by block forward substitution:
    Tinv_ij = -D_i sum_{j <= k < i} L_ik Tinv_kj        (i > j, Tinv_jj = D_j)
so every GEMM is 16 x 16 x 16 and one program (one warp) holds a chunk in registers, where the
doubling over the whole 64 x 64 matrix chained twelve 64-wide GEMMs through shared memory.
GEMMs on fp32 operands (PRECISION: tf32 for half-precision inputs). Numeric range: |KK| <= 1
(unit-norm k, decays <= 1) and beta in (0, 1), so Tinv's entries stay below 2^63 (C = 64 forward
substitution with |L| <= 1). Blocks across documents come out exactly zero, as L's are.
"""

import triton
import triton.language as tl


@triton.jit
def diagonal_block_inverse(L, SUBTILE: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^{-1} for strictly lower L [SUBTILE, SUBTILE], by doubling: with the diagonal
    blocks of size s inverted (inv), [[A, 0], [E, D]]^{-1} = inv - inv E inv, E being L's
    couplings between the halves of each 2s-block. Unlike the Neumann product, no growing powers
    of L cancel, so fp32 keeps its digits."""
    tl.static_assert(SUBTILE == 16)
    rows = tl.arange(0, SUBTILE)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    block = 1
    for _ in tl.static_range(4):
        same_pair = (rows[:, None] // (2 * block)) == (rows[None, :] // (2 * block))
        upper_row = ((rows[:, None] // block) % 2) == 1
        lower_col = ((rows[None, :] // block) % 2) == 0
        coupling = tl.where(same_pair & upper_row & lower_col, L, 0.0)
        inv = inv - tl.dot(tl.dot(inv, coupling, input_precision=PRECISION), inv,
                           input_precision=PRECISION)
        block *= 2
    return inv


@triton.jit
def l_block(KK, beta, b, h, t0, T, Tp, i: tl.constexpr, j: tl.constexpr, H: tl.constexpr,
            C: tl.constexpr, SUBTILE: tl.constexpr):
    """Block (i, j) of L = Diag(beta) KK, fp32."""
    rows = i * SUBTILE + tl.arange(0, SUBTILE)
    cols = j * SUBTILE + tl.arange(0, SUBTILE)
    beta_r = tl.load(beta + (b * T + t0 + rows) * H + h, mask=t0 + rows < T,
                     other=0.0).to(tl.float32)
    return beta_r[:, None] * tl.load(KK + ((b * Tp + t0 + rows) * H + h)[:, None] * C
                                     + cols[None, :])


@triton.jit
def store_block(Tinv, x, b, h, t0, Tp, i: tl.constexpr, j: tl.constexpr, H: tl.constexpr,
                C: tl.constexpr, SUBTILE: tl.constexpr):
    rows = i * SUBTILE + tl.arange(0, SUBTILE)
    cols = j * SUBTILE + tl.arange(0, SUBTILE)
    tl.store(Tinv + ((b * Tp + t0 + rows) * H + h)[:, None] * C + cols[None, :], x)


@triton.jit
def unit_lower_inverse_kernel(
    KK, beta, Tinv, T,
    H: tl.constexpr, C: tl.constexpr, SUBTILE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Tinv [B,Tp,H,C] fp32, upper blocks written as zeros. One program per (chunk,
    batch*head)."""
    tl.static_assert(C == 4 * SUBTILE)
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t0 = chunk * C
    Tp = tl.num_programs(0) * C
    D0 = diagonal_block_inverse(l_block(KK, beta, b, h, t0, T, Tp, 0, 0, H, C, SUBTILE),
                                SUBTILE, PRECISION)
    D1 = diagonal_block_inverse(l_block(KK, beta, b, h, t0, T, Tp, 1, 1, H, C, SUBTILE),
                                SUBTILE, PRECISION)
    D2 = diagonal_block_inverse(l_block(KK, beta, b, h, t0, T, Tp, 2, 2, H, C, SUBTILE),
                                SUBTILE, PRECISION)
    D3 = diagonal_block_inverse(l_block(KK, beta, b, h, t0, T, Tp, 3, 3, H, C, SUBTILE),
                                SUBTILE, PRECISION)
    L10 = l_block(KK, beta, b, h, t0, T, Tp, 1, 0, H, C, SUBTILE)
    L20 = l_block(KK, beta, b, h, t0, T, Tp, 2, 0, H, C, SUBTILE)
    L21 = l_block(KK, beta, b, h, t0, T, Tp, 2, 1, H, C, SUBTILE)
    L30 = l_block(KK, beta, b, h, t0, T, Tp, 3, 0, H, C, SUBTILE)
    L31 = l_block(KK, beta, b, h, t0, T, Tp, 3, 1, H, C, SUBTILE)
    L32 = l_block(KK, beta, b, h, t0, T, Tp, 3, 2, H, C, SUBTILE)
    X10 = -tl.dot(D1, tl.dot(L10, D0, input_precision=PRECISION), input_precision=PRECISION)
    X21 = -tl.dot(D2, tl.dot(L21, D1, input_precision=PRECISION), input_precision=PRECISION)
    X32 = -tl.dot(D3, tl.dot(L32, D2, input_precision=PRECISION), input_precision=PRECISION)
    X20 = tl.dot(L20, D0, input_precision=PRECISION)
    X20 = -tl.dot(D2, tl.dot(L21, X10, acc=X20, input_precision=PRECISION),
                  input_precision=PRECISION)
    X31 = tl.dot(L31, D1, input_precision=PRECISION)
    X31 = -tl.dot(D3, tl.dot(L32, X21, acc=X31, input_precision=PRECISION),
                  input_precision=PRECISION)
    X30 = tl.dot(L30, D0, input_precision=PRECISION)
    X30 = tl.dot(L31, X10, acc=X30, input_precision=PRECISION)
    X30 = -tl.dot(D3, tl.dot(L32, X20, acc=X30, input_precision=PRECISION),
                  input_precision=PRECISION)
    zero = tl.zeros((SUBTILE, SUBTILE), dtype=tl.float32)
    store_block(Tinv, D0, b, h, t0, Tp, 0, 0, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 0, 1, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 0, 2, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 0, 3, H, C, SUBTILE)
    store_block(Tinv, X10, b, h, t0, Tp, 1, 0, H, C, SUBTILE)
    store_block(Tinv, D1, b, h, t0, Tp, 1, 1, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 1, 2, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 1, 3, H, C, SUBTILE)
    store_block(Tinv, X20, b, h, t0, Tp, 2, 0, H, C, SUBTILE)
    store_block(Tinv, X21, b, h, t0, Tp, 2, 1, H, C, SUBTILE)
    store_block(Tinv, D2, b, h, t0, Tp, 2, 2, H, C, SUBTILE)
    store_block(Tinv, zero, b, h, t0, Tp, 2, 3, H, C, SUBTILE)
    store_block(Tinv, X30, b, h, t0, Tp, 3, 0, H, C, SUBTILE)
    store_block(Tinv, X31, b, h, t0, Tp, 3, 1, H, C, SUBTILE)
    store_block(Tinv, X32, b, h, t0, Tp, 3, 2, H, C, SUBTILE)
    store_block(Tinv, D3, b, h, t0, Tp, 3, 3, H, C, SUBTILE)
