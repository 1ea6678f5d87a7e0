"""Chunked Kimi Delta Attention forward in Triton (fla layout, chunk 64 = four 16-token tiles).

For a chunk of C = 64 tokens with incoming state S0, G = cumsum(g) within the chunk, Gamma = exp(G),
gamma_C = Gamma's last row:
    L[r,j]    = beta_r sum_c k_rc k_jc exp(G_rc - G_jc)          j < r
    A_qk[r,j] = sum_c q_rc k_jc exp(G_rc - G_jc)                  j <= r
    M = (I + L)^{-1} Diag(beta),   W = M (Gamma * K),   U = M V,   V~ = U - W S0
    O = (Gamma * Q) S0 + A_qk V~,  S_next = Diag(gamma_C) S0 + ((gamma_C / Gamma) * K)^T V~
(spec §3; `chunk_kda_torch` is the same algorithm in plain PyTorch). Two kernels: `_intra_chunk`
per (chunk, batch*head) writes A_qk, W and U; `_chunk_scan` per (V block, batch*head) walks the
chunks in order, carrying S in registers, and writes O and the final state.

Missing so far: the backward pass, varlen (cu_seqlens / doc_ids), the torch.library triton_op
registration that makes it traceable by torch.compile, and any run on a GPU: it has only been
checked under TRITON_INTERPRET=1 on CPU, so it is not registered in CHUNK_KDA_BY_DEVICE.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.kda import CHUNK_SIZE as CHUNK

SUBTILE = 16
# Width of the V blocks: U is written block by block, and the scan runs one program per block.
V_BLOCK = 64


@triton.jit
def _intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    A_qk,
    L_scratch,
    W,
    U,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    SUBTILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A_qk [B,T,H,C], W [B,T,H,K], U [B,T,H,V] for one chunk of one (batch, head).

    Numeric range (g in [-5, 0]): exp(G_r - G_j) is split at the first row n of r's 16-row tile as
    exp(G_r - G_n) * exp(G_n - G_j). The row factor is <= 1. The column factor is <= 1 for j left
    of the tile and at most exp(15 * 5) = exp(75) for j inside it, below fp32's exp(88) ceiling;
    columns right of the tile would overflow, so their exponent is zeroed before the exp and the
    operand masked. Every product term is then finite, and the masked triangle of the diagonal
    tile (j > r) is dropped after the GEMM.
    """
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t0 = chunk * CHUNK
    rows = tl.arange(0, CHUNK)
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    tok_stride_k = H * K

    base_k = (b * T + t0) * tok_stride_k + h * K
    offs_k = base_k + rows[:, None] * tok_stride_k + cols_k[None, :]
    k_all = tl.load(k + offs_k, mask=k_ok[None, :], other=0.0).to(tl.float32)
    G_all = tl.cumsum(tl.load(g + offs_k, mask=k_ok[None, :], other=0.0).to(tl.float32), axis=0)
    beta_all = tl.load(beta + (b * T + t0 + rows) * H + h).to(tl.float32)

    base_a = (b * T + t0) * H * CHUNK + h * CHUNK
    sub = tl.arange(0, SUBTILE)
    for i in tl.static_range(CHUNK // SUBTILE):
        tile_rows = i * SUBTILE + sub
        offs_tile = base_k + tile_rows[:, None] * tok_stride_k + cols_k[None, :]
        q_tile = tl.load(q + offs_tile, mask=k_ok[None, :], other=0.0).to(tl.float32) * scale
        k_tile = tl.load(k + offs_tile, mask=k_ok[None, :], other=0.0).to(tl.float32)
        g_tile = tl.load(g + offs_tile, mask=k_ok[None, :], other=0.0).to(tl.float32)
        g_first = tl.sum(tl.where(sub[:, None] == 0, g_tile, 0.0), axis=0)
        # exp(G_r - G_n) from the tile's own cumsum: an exponent <= 0, no large G cancels.
        row_decay = tl.exp(tl.cumsum(g_tile, axis=0) - g_first[None, :])
        G_ref = tl.sum(tl.where(rows[:, None] == i * SUBTILE, G_all, 0.0), axis=0)
        reach = rows < (i + 1) * SUBTILE
        col_exponent = tl.where(reach[:, None], G_ref[None, :] - G_all, 0.0)
        col_op = tl.where(reach[:, None], k_all * tl.exp(col_exponent), 0.0)
        qk = tl.dot(q_tile * row_decay, tl.trans(col_op), input_precision=PRECISION)
        kk = tl.dot(k_tile * row_decay, tl.trans(col_op), input_precision=PRECISION)
        offs_a = base_a + tile_rows[:, None] * H * CHUNK + rows[None, :]
        tl.store(A_qk + offs_a, tl.where(rows[None, :] <= tile_rows[:, None], qk, 0.0))
        beta_tile = tl.load(beta + (b * T + t0 + tile_rows) * H + h).to(tl.float32)
        L_tile = tl.where(rows[None, :] < tile_rows[:, None], beta_tile[:, None] * kk, 0.0)
        tl.store(L_scratch + offs_a, L_tile)
    # L is read back whole by every thread of the program.
    tl.debug_barrier()
    offs_L = base_a + rows[:, None] * H * CHUNK + rows[None, :]
    L = tl.load(L_scratch + offs_L)

    # (I + L)^{-1} by blocked forward substitution with blocks doubling 1, 2, ..., 32: with the
    # diagonal blocks of size s inverted (inv), [[A, 0], [E, D]]^{-1} = inv - inv E inv, where E
    # keeps L's couplings between the halves of each 2s-block. Unlike the Neumann product, no
    # growing powers of L cancel, so fp32 keeps its digits.
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    block = 1
    for _ in tl.static_range(6):
        same_pair = (rows[:, None] // (2 * block)) == (rows[None, :] // (2 * block))
        upper_row = ((rows[:, None] // block) % 2) == 1
        lower_col = ((rows[None, :] // block) % 2) == 0
        coupling = tl.where(same_pair & upper_row & lower_col, L, 0.0)
        inv = inv - tl.dot(
            tl.dot(inv, coupling, input_precision=PRECISION), inv, input_precision=PRECISION
        )
        block *= 2
    M = inv * beta_all[None, :]

    W_chunk = tl.dot(M, k_all * tl.exp(G_all), input_precision=PRECISION)
    tl.store(W + offs_k, W_chunk, mask=k_ok[None, :])
    tok_stride_v = H * V
    base_v = (b * T + t0) * tok_stride_v + h * V
    for v0 in tl.static_range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        offs_v = base_v + rows[:, None] * tok_stride_v + cols_v[None, :]
        v_ok = cols_v[None, :] < V
        v_chunk = tl.load(v + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        tl.store(U + offs_v, tl.dot(M, v_chunk, input_precision=PRECISION), mask=v_ok)


@triton.jit
def _chunk_scan(
    q,
    k,
    g,
    A_qk,
    W,
    U,
    initial_state,
    o,
    final_state,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """O [B,T,H,V] and the final state for one V block of one (batch, head), chunk by chunk.

    Numeric range: only exp(G_r) and exp(G_C - G_r) appear, both <= 1 since G is nonincreasing.
    """
    v_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, CHUNK)
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_ok, v_ok = cols_k < K, cols_v < V
    state_offs = bh * K * V + cols_k[:, None] * V + cols_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_INITIAL:
        S = tl.load(initial_state + state_offs, mask=state_ok, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)

    # A while loop: Triton 3.6's interpreter cannot take a runtime range() bound under NumPy 2.
    t0 = 0
    while t0 < T:
        tok = b * T + t0 + rows
        offs_k = (tok * H + h)[:, None] * K + cols_k[None, :]
        offs_v = (tok * H + h)[:, None] * V + cols_v[None, :]
        offs_a = (tok * H + h)[:, None] * CHUNK + rows[None, :]
        G = tl.cumsum(tl.load(g + offs_k, mask=k_ok[None, :], other=0.0).to(tl.float32), axis=0)
        G_end = tl.sum(tl.where(rows[:, None] == CHUNK - 1, G, 0.0), axis=0)
        q_base = tl.load(q + offs_k, mask=k_ok[None, :], other=0.0).to(tl.float32) * scale
        q_base *= tl.exp(G)
        k_to_end = tl.load(k + offs_k, mask=k_ok[None, :], other=0.0).to(tl.float32)
        k_to_end *= tl.exp(G_end[None, :] - G)
        W_chunk = tl.load(W + offs_k, mask=k_ok[None, :], other=0.0)
        U_chunk = tl.load(U + offs_v, mask=v_ok[None, :], other=0.0)
        A_chunk = tl.load(A_qk + offs_a)

        v_new = U_chunk - tl.dot(W_chunk, S, input_precision=PRECISION)
        o_chunk = tl.dot(q_base, S, input_precision=PRECISION)
        o_chunk += tl.dot(A_chunk, v_new, input_precision=PRECISION)
        tl.store(o + offs_v, o_chunk.to(o.dtype.element_ty), mask=v_ok[None, :])
        S = tl.exp(G_end)[:, None] * S
        S += tl.dot(tl.trans(k_to_end), v_new, input_precision=PRECISION)
        t0 += CHUNK

    if STORE_FINAL:
        tl.store(final_state + state_offs, S, mask=state_ok)


def chunk_kda_fwd_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; states [B,H,K,V] float32; g in [-5, 0].

    Returns (o [B,T,H,V] in q's dtype, final state float32 or None). T is padded to a multiple of
    64 with tokens that leave the state untouched (k = 0, beta = 0, g = 0).
    """
    batch, seq_len, heads, d_k = q.shape
    d_v = v.shape[-1]
    if d_k > 128 or d_v > 128:
        raise ValueError(f"head dims up to 128 are supported, got K={d_k}, V={d_v}")
    scale = d_k**-0.5 if scale is None else scale
    pad = -seq_len % CHUNK
    padded = seq_len + pad

    def prepare(x: Tensor) -> Tensor:
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)).contiguous()

    q, k, v, g, beta = (prepare(x) for x in (q, k, v, g, beta))
    n_chunks = padded // CHUNK
    # float32 inputs get IEEE fp32 GEMMs (the tests' 1e-4 bound); half precision gets tf32.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_k = max(triton.next_power_of_2(d_k), 16)
    block_v = min(max(triton.next_power_of_2(d_v), 16), V_BLOCK)

    f32 = dict(device=q.device, dtype=torch.float32)
    A_qk = torch.empty(batch, padded, heads, CHUNK, **f32)
    L_scratch = torch.empty_like(A_qk)
    W = torch.empty(batch, padded, heads, d_k, **f32)
    U = torch.empty(batch, padded, heads, d_v, **f32)
    _intra_chunk[(n_chunks, batch * heads)](
        q, k, v, g, beta, A_qk, L_scratch, W, U, scale, padded,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, CHUNK=CHUNK, SUBTILE=SUBTILE,
        PRECISION=precision,
    )  # fmt: skip

    o = torch.empty(batch, padded, heads, d_v, device=q.device, dtype=q.dtype)
    final = torch.empty(batch, heads, d_k, d_v, **f32) if output_final_state else None
    initial = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    _chunk_scan[(triton.cdiv(d_v, block_v), batch * heads)](
        q, k, g, A_qk, W, U, initial, o, final, scale, padded,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, CHUNK=CHUNK,
        HAS_INITIAL=initial is not None, STORE_FINAL=output_final_state, PRECISION=precision,
    )  # fmt: skip
    return o[:, :seq_len], final
