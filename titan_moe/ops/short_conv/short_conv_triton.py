"""Short convolution (causal depthwise conv + SiLU + optional per-head L2 norm) in Triton.

    forward   one program per (BLOCK_T rows of one sequence, CH channels)
    backward  dz: one program per forward tile; dx, dweight: one persistent program per
              (group of row blocks, CH channels)

CH is one head (head_dim) when the norm is on, so ||a|| is a row reduction inside the program;
without the norm CH is up to 128 channels. The forward reads the K taps of a row block as K
loads shifted by 0..K−1 rows (the K−1 halo rows above the block come from the first ones; the
overlap hits L1/L2), masks taps before t = 0 or in another document (doc_ids of the tap row ≠
the row's own), and computes in fp32: z = Σ_j w_j x_{t−(K−1−j)}, a = SiLU(z), y = a / max(||a||,
eps) per head, stored in x's dtype. It saves nothing: autograd keeps x and the weight anyway.

The backward is two kernels. `short_conv_bwd_dz_kernel` recomputes z at the forward's tiles
(K shifted loads of x) and writes dz = dL/dz in fp32 through SiLU's and the norm's backward.
`short_conv_bwd_dx_kernel` then gathers dx_t = Σ_s w_{K−1−s} dz_{t+s} over the rows t + s
(s < K) of t's document (K shifted loads of dz, L1/L2 hits but for the first) and, from the
s = 0 tile, dweight[c, j] = Σ_t dz_t x_{t−(K−1−j)} (same mask): each program accumulates its
rows' share in registers and writes one [C, K] fp32 partial; PyTorch sums the partials (one per
program along the rows, at most TARGET_PROGRAMS / channel blocks of them, so the buffer stays
small): deterministic, no atomics. DRAM sees x twice, dy and dz once, dz and dx written: 16
bytes an element in bf16 against the floor's 6. A single kernel that instead recomputed dz at
each of the K shifts (K² + K tile loads of x and K SiLU/norm backwards per tile) moved the floor's
bytes but took 0.51 ms a call at the proxy's q/k/v shape on the H200 (2026-12-04), bound by its
registers and recomputation; dz through L2 and DRAM costs about 0.07 ms there.

Backward of the norm, F.normalize's semantics y = a / max(||a||, eps): da = (dy − y <dy, y>) /
||a|| where ||a|| >= eps (torch's clamp_min passes the gradient at equality), da = dy / eps
below it. Of SiLU: dz = da σ(z) (1 + z (1 − σ(z))).

Launch parameters are fixed, no autotuning, so each kernel compiles in about a second. A
program's tile holds FWD_TILE elements (16 rows of a 128-channel head: the forward and the dz
kernel) or BWD_TILE (the dx kernel), 4 warps. Untuned on a GPU beyond the one measurement
above: bench/short_conv.py times them.

`titan_moe::short_conv` and `titan_moe::short_conv_bwd` are `torch.library.triton_op`s (torch
.compile sees the kernels; autograd is registered on the forward). Inductor cannot compile user
Triton kernels for CPU tensors: callers branch on the device (`titan_moe.ops.short_conv`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.short_conv.naive import NORM_EPS

# BLOCK_T * BLOCK_C of a program's tiles, forward and backward, and their warps.
FWD_TILE, FWD_WARPS = 2048, 4
BWD_TILE, BWD_WARPS = 2048, 4
MAX_BLOCK_T = 32
NO_NORM_CHANNELS = 128  # channels a program takes when there is no per-head norm
TARGET_PROGRAMS = 1024  # backward programs (row groups x channel blocks): dweight partials


@triton.jit
def _tap(x_seq, doc_seq, rows, row_ok, doc_rows, cols, col_ok, C, shift,
         HAS_DOCS: tl.constexpr):  # fmt: skip
    """x_{t−shift} at rows t as fp32, zero where t − shift < 0 or in another document."""
    src = rows - shift
    ok = row_ok & (src >= 0)
    if HAS_DOCS:
        ok = ok & (tl.load(doc_seq + src, mask=ok, other=0) == doc_rows)
    offs = src.to(tl.int64)[:, None] * C + cols[None, :]
    return tl.load(x_seq + offs, mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _preactivation(x_seq, w_ptr, doc_seq, rows, row_ok, doc_rows, cols, col_ok, C,
                   K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                   HAS_DOCS: tl.constexpr):  # fmt: skip
    """z_t = Σ_j w[:, j] x_{t−(K−1−j)} at rows t: [BLOCK_T, BLOCK_C] fp32."""
    z = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + cols * K + j, mask=col_ok, other=0.0).to(tl.float32)
        xv = _tap(x_seq, doc_seq, rows, row_ok, doc_rows, cols, col_ok, C, K - 1 - j, HAS_DOCS)
        z += xv * w[None, :]
    return z


@triton.jit
def _row_docs(doc_seq, rows, row_ok, HAS_DOCS: tl.constexpr):
    if HAS_DOCS:
        return tl.load(doc_seq + rows, mask=row_ok, other=0)
    else:
        return 0


@triton.jit
def _tile_coords(T, C, n_t_blocks, CH: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    """This program's tile of the forward: BLOCK_T rows of one sequence (its first element's
    offset seq * C), CH channels. Takes no pointer: Inductor's analysis of which tensors a
    kernel writes follows a store's offsets back through every argument of the call that made
    them, and would count pointers passed here as written (then clone them, and refuse to
    CUDA-graph a region whose input they are)."""
    pid = tl.program_id(0)
    seq = (pid // n_t_blocks).to(tl.int64) * T
    rows = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    lanes = tl.arange(0, BLOCK_C)
    cols = tl.program_id(1) * CH + lanes
    return seq, rows, rows < T, cols, (lanes < CH) & (cols < C)


@triton.jit
def _tile_preactivation(x_ptr, w_ptr, doc_ptr, seq, rows, row_ok, cols, col_ok, C,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        HAS_DOCS: tl.constexpr):  # fmt: skip
    """The tile's pre-activation z, fp32."""
    x_seq = x_ptr + seq * C
    doc_seq = doc_ptr
    if HAS_DOCS:
        doc_seq = doc_ptr + seq
    doc_rows = _row_docs(doc_seq, rows, row_ok, HAS_DOCS)
    return _preactivation(x_seq, w_ptr, doc_seq, rows, row_ok, doc_rows, cols, col_ok, C,
                          K, BLOCK_T, BLOCK_C, HAS_DOCS)  # fmt: skip


@triton.jit
def short_conv_fwd_kernel(
    x_ptr, w_ptr, doc_ptr, y_ptr, T, C, n_t_blocks,
    K: tl.constexpr, CH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_DOCS: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    seq, rows, row_ok, cols, col_ok = _tile_coords(T, C, n_t_blocks, CH, BLOCK_T, BLOCK_C)
    z = _tile_preactivation(x_ptr, w_ptr, doc_ptr, seq, rows, row_ok, cols, col_ok, C,
                            K, BLOCK_T, BLOCK_C, HAS_DOCS)  # fmt: skip
    offs = seq * C + rows.to(tl.int64)[:, None] * C + cols[None, :]
    in_tile = row_ok[:, None] & col_ok[None, :]
    y = z * tl.sigmoid(z)
    if NORM:
        norm = tl.sqrt(tl.sum(y * y, axis=1))
        y = y / tl.maximum(norm, EPS)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=in_tile)


@triton.jit
def _grad_preactivation(z, dy, NORM: tl.constexpr, EPS: tl.constexpr):
    """dL/dz from dL/dy through SiLU and (NORM) y = a / max(||a||, eps) per row."""
    sig = tl.sigmoid(z)
    da = dy
    if NORM:
        a = z * sig
        norm = tl.sqrt(tl.sum(a * a, axis=1))
        inv = 1.0 / tl.maximum(norm, EPS)
        y = a * inv[:, None]
        proj = tl.sum(dy * y, axis=1)
        da = tl.where((norm >= EPS)[:, None], dy - y * proj[:, None], dy) * inv[:, None]
    return da * sig * (1.0 + z * (1.0 - sig))


@triton.jit
def short_conv_bwd_dz_kernel(
    x_ptr, w_ptr, doc_ptr, dy_ptr, dz_ptr, T, C, n_t_blocks,
    K: tl.constexpr, CH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_DOCS: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    """dz = dL/dz (fp32) at the forward's tiles: z recomputed from x, then SiLU's and the norm's
    backward."""
    seq, rows, row_ok, cols, col_ok = _tile_coords(T, C, n_t_blocks, CH, BLOCK_T, BLOCK_C)
    z = _tile_preactivation(x_ptr, w_ptr, doc_ptr, seq, rows, row_ok, cols, col_ok, C,
                            K, BLOCK_T, BLOCK_C, HAS_DOCS)  # fmt: skip
    offs = seq * C + rows.to(tl.int64)[:, None] * C + cols[None, :]
    in_tile = row_ok[:, None] & col_ok[None, :]
    dy = tl.load(dy_ptr + offs, mask=in_tile, other=0.0).to(tl.float32)
    tl.store(dz_ptr + offs, _grad_preactivation(z, dy, NORM, EPS), mask=in_tile)


@triton.jit
def short_conv_bwd_dx_kernel(
    x_ptr, w_ptr, doc_ptr, dz_ptr, dx_ptr, dw_ptr, T, C, n_t_blocks, n_blocks, n_programs,
    K: tl.constexpr, CH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """dx_t = Σ_s w[:, K−1−s] dz_{t+s} over the rows t + s of t's document, and this program's
    share of dweight[:, j] = Σ_t dz_t x_{t−(K−1−j)} (same mask) as one [C, K] partial."""
    lanes = tl.arange(0, BLOCK_C)
    cols = tl.program_id(1) * CH + lanes
    col_ok = (lanes < CH) & (cols < C)
    taps = tl.arange(0, BLOCK_K)
    # dweight's products stay per row until the end (one [BLOCK_T, BLOCK_C] tile a tap): a
    # cross-row reduction per row block cost more than the loads it sits between.
    dw_tiles = tl.zeros([BLOCK_T, BLOCK_K, BLOCK_C], dtype=tl.float32)
    # Row blocks pid, pid + n_programs, ... (n_programs: the grid's first size). A while loop:
    # Triton 3.6's interpreter cannot take a runtime range() bound under NumPy 2.
    block = tl.program_id(0)
    while block < n_blocks:
        seq = (block // n_t_blocks).to(tl.int64) * T
        rows = (block % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        x_seq = x_ptr + seq * C
        dz_seq = dz_ptr + seq * C
        doc_seq = doc_ptr
        if HAS_DOCS:
            doc_seq = doc_ptr + seq
        doc_rows = _row_docs(doc_seq, rows, row_ok, HAS_DOCS)
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for s in tl.static_range(K):
            later = rows + s
            reach = later < T
            if HAS_DOCS:
                reach = reach & (tl.load(doc_seq + later, mask=reach, other=0) == doc_rows)
            offs = later.to(tl.int64)[:, None] * C + cols[None, :]
            dz_later = tl.load(dz_seq + offs, mask=reach[:, None] & col_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols * K + (K - 1 - s), mask=col_ok, other=0.0).to(tl.float32)
            dx += dz_later * w[None, :]
            if s == 0:
                for j in tl.static_range(K):
                    xv = _tap(x_seq, doc_seq, rows, row_ok, doc_rows, cols, col_ok, C,
                              K - 1 - j, HAS_DOCS)  # fmt: skip
                    dw_tiles += tl.where(taps[None, :, None] == j,
                                         (dz_later * xv)[:, None, :], 0.0)
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(dx_ptr + seq * C + offs, dx.to(dx_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        block += n_programs
    dw = tl.trans(tl.sum(dw_tiles, axis=0))  # [BLOCK_C, BLOCK_K]
    dw_offs = tl.program_id(0).to(tl.int64) * C * K + cols[:, None] * K + taps[None, :]
    tl.store(dw_ptr + dw_offs, dw, mask=col_ok[:, None] & (taps[None, :] < K))


def validate_short_conv_inputs(
    x: Tensor, weight: Tensor, doc_ids: Tensor | None, head_dim: int | None
) -> None:
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    batch, seq_len, channels = x.shape
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, K] = [{channels}, K >= 1], got "
                         f"{tuple(weight.shape)}")
    if doc_ids is not None and tuple(doc_ids.shape) != (batch, seq_len):
        raise ValueError(f"doc_ids must be [B, T] = [{batch}, {seq_len}], got "
                         f"{tuple(doc_ids.shape)}")
    if head_dim is not None and (head_dim < 0 or (head_dim and channels % head_dim)):
        raise ValueError(f"head_dim must divide C = {channels} (or be None/0: no norm), got "
                         f"{head_dim}")


def _launch(x: Tensor, head_dim: int, tile: int) -> tuple[int, int, int, int]:
    """(channels a program takes, BLOCK_C, BLOCK_T, channel blocks)."""
    channels = x.shape[-1]
    per_program = head_dim if head_dim else min(NO_NORM_CHANNELS, channels)
    block_c = triton.next_power_of_2(per_program)
    block_t = max(1, min(MAX_BLOCK_T, tile // block_c))
    return per_program, block_c, block_t, triton.cdiv(channels, per_program)


@triton_op("titan_moe::short_conv", mutates_args=())
def short_conv_triton(x: Tensor, weight: Tensor, doc_ids: Tensor | None, head_dim: int) -> Tensor:
    """`naive.short_conv_naive` in one kernel: x [B, T, C] (fp32/bf16/fp16), weight [C, K],
    doc_ids [B, T] int or None, head_dim (0: no norm) -> y [B, T, C] in x's dtype."""
    validate_short_conv_inputs(x, weight, doc_ids, head_dim)
    x, weight = x.contiguous(), weight.contiguous()
    doc_ids = None if doc_ids is None else doc_ids.contiguous()
    batch, seq_len, channels = x.shape
    per_program, block_c, block_t, n_c_blocks = _launch(x, head_dim, FWD_TILE)
    n_t_blocks = triton.cdiv(seq_len, block_t)
    y = torch.empty_like(x)
    wrap_triton(short_conv_fwd_kernel)[(batch * n_t_blocks, n_c_blocks)](
        x, weight, doc_ids, y, seq_len, channels, n_t_blocks,
        K=weight.shape[1], CH=per_program, BLOCK_T=block_t, BLOCK_C=block_c,
        HAS_DOCS=doc_ids is not None, NORM=head_dim > 0, EPS=NORM_EPS, num_warps=FWD_WARPS,
    )  # fmt: skip
    return y


@triton_op("titan_moe::short_conv_bwd", mutates_args=())
def short_conv_bwd_triton(
    dy: Tensor, x: Tensor, weight: Tensor, doc_ids: Tensor | None, head_dim: int
) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dweight in weight's dtype) of `short_conv_triton` given dy."""
    dy, x, weight = dy.contiguous(), x.contiguous(), weight.contiguous()
    doc_ids = None if doc_ids is None else doc_ids.contiguous()
    batch, seq_len, channels = x.shape
    taps = weight.shape[1]
    per_program, block_c, block_t, n_c_blocks = _launch(x, head_dim, FWD_TILE)
    n_t_blocks = triton.cdiv(seq_len, block_t)
    docs = doc_ids is not None
    dz = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    wrap_triton(short_conv_bwd_dz_kernel)[(batch * n_t_blocks, n_c_blocks)](
        x, weight, doc_ids, dy, dz, seq_len, channels, n_t_blocks,
        K=taps, CH=per_program, BLOCK_T=block_t, BLOCK_C=block_c, HAS_DOCS=docs,
        NORM=head_dim > 0, EPS=NORM_EPS, num_warps=FWD_WARPS,
    )  # fmt: skip
    per_program, block_c, block_t, n_c_blocks = _launch(x, head_dim, BWD_TILE)
    n_t_blocks = triton.cdiv(seq_len, block_t)
    n_blocks = batch * n_t_blocks
    n_row_programs = max(1, min(n_blocks, TARGET_PROGRAMS // n_c_blocks))
    dx = torch.empty_like(x)
    partial = torch.empty(n_row_programs, channels, taps, device=x.device, dtype=torch.float32)
    wrap_triton(short_conv_bwd_dx_kernel)[(n_row_programs, n_c_blocks)](
        x, weight, doc_ids, dz, dx, partial, seq_len, channels, n_t_blocks, n_blocks,
        n_row_programs,
        K=taps, CH=per_program, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(taps), HAS_DOCS=docs, num_warps=BWD_WARPS,
    )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, doc_ids, head_dim = inputs
    ctx.save_for_backward(x, weight, doc_ids)
    ctx.head_dim = head_dim


def _backward(ctx, dy: Tensor):
    x, weight, doc_ids = ctx.saved_tensors
    dx, dweight = short_conv_bwd_triton(dy, x, weight, doc_ids, ctx.head_dim)
    return dx, dweight, None, None


short_conv_triton.register_autograd(_backward, setup_context=_setup_context)
