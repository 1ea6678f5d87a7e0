"""Chunked KDA as a user-defined Triton op that torch.compile traces (fullgraph, no break).

    forward:  gate_cumsum -> tile_products -> unit_lower_inverse -> ut_transform
              -> state_scan_fwd -> chunk_output
    backward: chunk_output_bwd -> state_scan_bwd | state_terms_bwd | ut_transform_bwd
              -> tile_products_bwd -> gate_cumsum_bwd   (three ops, split at the bars)
    by segments, each segment's backward first recomputes gate_cumsum -> tile_products
              -> unit_lower_inverse -> ut_transform -> state_scan_fwd

`titan_moe::chunk_kda_fwd` and the backward ops are `torch.library.triton_op`s, so Inductor sees
the kernels (and their fake shapes) instead of an opaque call; autograd is registered on the
forward op. The forward keeps its inputs and, when a backward will run on a sequence of one
segment, what the backward would otherwise recompute (KEPT): the chunk matrices A_qk, KK, Tinv
(fp32), G (fp32), W and K_d (the scans' operand dtype), the chunk-entry states (operand dtype,
32 KiB a chunk at K = V = 128 in bf16; state_scan.py says what that costs d g) and V~ (operand
dtype); U only feeds the forward scan, whose V~ replaces it. With bf16 inputs at K = V = 128
that is 2,560 B a token and head (768 of them the matrices kept before 2026-12-05, 512 the
states), 2.5 GiB at 64K tokens and 16 heads; the backward then launches only
its six kernels (the recomputation was gate_cumsum, ut_transform and state_scan_fwd, 2.6 of
19.7 ms f+b at 64K on the H100). The backward takes the kept buffers off the autograd context
rather than saving them (saved tensors live until the whole backward returns, an op's arguments
until the op does) and runs as three ops, each the last reader of some: A_qk, W, K_d go with the
first, the states with the second. So an eager f+b peaks where the backward that recomputes
does, at tile_products_bwd, the states let go (bench/kda_memory.py: 6.55 GiB at 64K x 16 heads,
the gradients returned; with the states in fp32 it peaked at the state terms); autograd fills
no zero gradient for the kept buffers (set_materialize_grads off); Inductor frees the kept buffers
by last use itself.
A second backward through a retained graph finds them handed over and recomputes. Under
saved-tensor hooks (activation checkpointing, offloading: they see saved tensors only) the
buffers are saved instead, so a checkpoint drops them until its recompute; a non-reentrant
checkpoint lets go of what it unpacks, so the backward still frees them as it goes (seen on
CPU with a toy Function).

The backward's buffers (kept or recomputed) and the gradients' peak at 5,420 B a token and head
at K = V = 128, dO included (5.3 GiB at 64K tokens and 16 heads), so a sequence longer than
SEGMENT tokens runs by segments, the state passed from one to the next: forward in order,
keeping nothing, backward last segment first, each from the state entering it (one more
forward pass over the segments finds those states first). Both then hold one segment's buffers
at any length, for that extra pass at long context.

With `A_log`/`dt_bias` the kernels compute the lower-bounded gate
g = g_min sigmoid(exp(A_log) (g_raw + dt_bias)) themselves, and its chunk-local cumsum, and
return the gradients of g_raw, A_log and dt_bias (the last two summed per chunk by the gate's
backward kernel, then over chunks here: B * n_chunks * H * K floats, not the [B,T,H,K] tensors).

Inductor cannot compile user Triton kernels for CPU tensors, so callers pick this op for CUDA
tensors only (`titan_moe.ops.kda.chunk_kda` branches on the device); tests call it on CPU
under TRITON_INTERPRET=1.
"""

import torch
import triton
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.kda.chunk_common import CHUNK, SUBTILE
from titan_moe.ops.kda.chunk_output import chunk_output_bwd_kernel, chunk_output_kernel
from titan_moe.ops.kda.gate import validate_gate_params
from titan_moe.ops.kda.gate_cumsum import gate_cumsum_bwd_kernel, gate_cumsum_kernel
from titan_moe.ops.kda.naive import validate_kda_inputs
from titan_moe.ops.kda.state_scan import (
    state_scan_bwd_kernel,
    state_scan_fwd_kernel,
    state_terms_bwd_kernel,
)
from titan_moe.ops.kda.tile_products import tile_products_bwd_kernel, tile_products_kernel
from titan_moe.ops.kda.unit_lower_inverse import unit_lower_inverse_kernel
from titan_moe.ops.kda.ut_transform import ut_transform_bwd_kernel, ut_transform_kernel

# V blocks of the scans (the sequential part runs one program per V block and head: 32 gives
# 64 programs at the proxy's 16 heads, and no spills) and of the other kernels' V loops.
BLOCK_V = 32
# Tokens a segment (a multiple of CHUNK): shorter sequences run whole.
SEGMENT = 65536
# What the forward of a one-segment sequence keeps for the backward when one will run: the
# chunk matrices (fp32 [B,Tp,H,C]), the gate's cumsum G (fp32 [B,Tp,H,K]), W and K_d (the
# scans' operand dtype, [B,Tp,H,K]), the chunk-entry states (operand dtype [B,NC,H,K,V]) and V~
# (operand dtype, [B,Tp,H,V]): the backward then launches none of the forward's kernels.
KEPT = ("A_qk", "KK", "Tinv", "G", "W", "K_d", "h_states", "v_new")
# K (and V) blocks of the parallel kernels: the tiles that fit in registers without spilling
# (bench/kda_compile.py reports each kernel's registers and spills).
BLOCK_INTRA = 32
MAX_HEAD_DIM = 256
# The GEMM operands for half-precision inputs (_operand; bench/kda.py --gemms): "bf16" (fp32
# accumulation, tensor cores at full rate) or "tf32" (fp32 operands, half the rate, twice the
# shared memory). Each kernel's module says what bf16 costs in accuracy.
GEMMS = "bf16"
# Pipeline stages of the scans' chunk loops (bench/kda_kernels.py times other depths).
SCAN_STAGES = 3
# Warps a program, by kernel, and pipeline stages where not Triton's default of 3: each
# kernel's fastest of 2/4/8 warps x 1-3 stages alone at (1, 8192, 16, 128), bf16, on the H100
# (bench/kda_kernels.py, 2026-12-05, kda_kernels-2026-12-05-h100-64df522.json), where a
# setting beat the former one by more than 5%. The scans at 4 warps and 3 stages took 0.220,
# 0.204 (forward, twice) and 0.263 ms (backward) against 0.366, 0.355, 0.434 at 8 warps and 2;
# tile_products 0.176 at 2 warps and 2 stages against 0.204 at 4 and 3; state_terms_bwd 0.258
# at 4 warps against 0.301 at 8. One stage is never used: the forward scan at 8 warps and
# ut_transform_bwd at 4 ended in an illegal memory access there on the H100. The second sweep
# (kda_kernels-2026-12-05-h100-465ce3a.json, 1-8 warps, 2-3 stages) moved three more:
# ut_transform_bwd 0.287 ms at 4 warps against 0.355 at 8, ut_transform 0.143 / 0.141 at 4
# against 0.152 / 0.150, gate_cumsum_bwd 0.065 at 1 against 0.069 at 4.
NUM_WARPS = {
    "gate_cumsum_kernel": 4,
    "tile_products_kernel": 2,
    "unit_lower_inverse_kernel": 1,
    "ut_transform_kernel": 4,
    "state_scan_fwd_kernel": 4,
    "chunk_output_kernel": 8,
    "chunk_output_bwd_kernel": 8,
    "state_scan_bwd_kernel": 4,
    "state_terms_bwd_kernel": 4,
    "ut_transform_bwd_kernel": 4,
    "tile_products_bwd_kernel": 2,
    "gate_cumsum_bwd_kernel": 1,
}
# tile_products_bwd_kernel: 2 stages (its loops run at most 3 blocks; 8 kB shared against 14 at 3,
# 168 registers at both), fla's tuned depth for its like-shaped intra backward; unmeasured.
NUM_STAGES = {"tile_products_kernel": 2, "tile_products_bwd_kernel": 2}


def _precise(x: Tensor) -> str:
    """The GEMMs that keep fp32 operands: the inverse's and tile_products_bwd_kernel's (their
    modules say why). float32 inputs get IEEE fp32 GEMMs (the 1e-4 test bound); half
    precision gets tf32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _operand(x: Tensor) -> str:
    """The operands of every other GEMM (chunk_common.mma): GEMMS for half-precision inputs."""
    if x.dtype == torch.float32:
        return "ieee"
    if GEMMS == "tf32":
        return "tf32"
    return "bf16_emulated" if triton.knobs.runtime.interpret else "bf16"


def _blocks(d_k: int, d_v: int) -> tuple[int, int, int]:
    """(the whole K padded to a power of two: the scans' state rows, the V block, the K and V
    block of the parallel kernels)."""
    block_k = max(triton.next_power_of_2(d_k), 16)
    block_v = min(max(triton.next_power_of_2(d_v), 16), BLOCK_V)
    return block_k, block_v, min(block_k, BLOCK_INTRA)


def _intra(q, k, v, g, beta, doc, A_log, dt_bias, scale, g_min):
    """G, A_qk, KK, Tinv, W, U, K_d of every chunk."""
    batch, seq_len, heads, d_k = q.shape
    d_v = v.shape[-1]
    n_chunks = triton.cdiv(seq_len, CHUNK)
    padded = n_chunks * CHUNK
    _, block_v, block = _blocks(d_k, d_v)
    f32 = dict(device=q.device, dtype=torch.float32)
    operand = _operand(q)
    G = torch.empty(batch, padded, heads, d_k, **f32)
    # W and K_d feed only the scans' GEMMs (tile_products_bwd_kernel recomputes K_d), so they are
    # stored as those GEMMs' operands: bf16 halves the scans' loads and changes no value.
    scan_dtype = torch.bfloat16 if operand.startswith("bf16") else torch.float32
    W = torch.empty(batch, padded, heads, d_k, device=q.device, dtype=scan_dtype)
    K_d = torch.empty_like(W)
    U = torch.empty(batch, padded, heads, d_v, **f32)
    wrap_triton(gate_cumsum_kernel)[(n_chunks, triton.cdiv(d_k, block), batch * heads)](
        g, A_log, dt_bias, G, g_min, seq_len,
        H=heads, K=d_k, BK=block, C=CHUNK, FUSED_GATE=A_log is not None,
        num_warps=NUM_WARPS["gate_cumsum_kernel"],
    )  # fmt: skip
    A_qk = torch.empty(batch, padded, heads, CHUNK, **f32)
    KK, Tinv = torch.empty_like(A_qk), torch.empty_like(A_qk)
    wrap_triton(tile_products_kernel)[(CHUNK // SUBTILE, n_chunks, batch * heads)](
        q, k, G, doc, A_qk, KK, scale, seq_len,
        H=heads, K=d_k, BK=block, C=CHUNK, SUBTILE=SUBTILE, HAS_DOCS=doc is not None,
        OPERAND=operand,
        num_warps=NUM_WARPS["tile_products_kernel"],
        num_stages=NUM_STAGES["tile_products_kernel"],
    )  # fmt: skip
    wrap_triton(unit_lower_inverse_kernel)[(n_chunks, batch * heads)](
        KK, beta, Tinv, seq_len, H=heads, C=CHUNK, SUBTILE=SUBTILE, PRECISION=_precise(q),
        num_warps=NUM_WARPS["unit_lower_inverse_kernel"],
    )  # fmt: skip
    wrap_triton(ut_transform_kernel)[(n_chunks, batch * heads)](
        k, v, G, beta, doc, Tinv, W, U, K_d, seq_len,
        H=heads, K=d_k, V=d_v, BK=block, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        OPERAND=operand, num_warps=NUM_WARPS["ut_transform_kernel"],
    )  # fmt: skip
    return G, A_qk, KK, Tinv, W, U, K_d


def _scan(K_d, G, W, U, doc, initial_state, output_final_state, seq_len, operand):
    batch, _, heads, d_k = K_d.shape
    d_v = U.shape[-1]
    n_chunks = triton.cdiv(seq_len, CHUNK)
    block_k, block_v, _ = _blocks(d_k, d_v)
    # The chunk-entry states and V~ are stored in the scans' operand dtype. V~ is read only as
    # a GEMM operand (the output, the state terms, dA); the states are too, but for the state
    # terms' d gamma_C = sum_v S * dS (state_scan.py says what bf16 costs there). The running
    # state stays in fp32 registers, and the final one is returned in fp32.
    h_states = torch.empty(batch, n_chunks, heads, d_k, d_v, device=K_d.device, dtype=W.dtype)
    v_new = torch.empty_like(U, dtype=W.dtype)
    final = (torch.empty(batch, heads, d_k, d_v, device=K_d.device, dtype=torch.float32)
             if output_final_state else None)
    wrap_triton(state_scan_fwd_kernel)[(triton.cdiv(d_v, block_v), batch * heads)](
        K_d, G, W, U, doc, initial_state, h_states, v_new, final, seq_len,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        HAS_INITIAL=initial_state is not None, STORE_FINAL=output_final_state,
        OPERAND=operand, INTERPRETED=triton.knobs.runtime.interpret, STAGES=SCAN_STAGES,
        num_warps=NUM_WARPS["state_scan_fwd_kernel"],
    )  # fmt: skip
    return h_states, v_new, final


def _forward_segment(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, scale, g_min,
                     output_final_state, keep=False):
    """One segment's forward: (o, final state or None, the KEPT buffers or None)."""
    batch, seq_len, heads, d_k = q.shape
    d_v = v.shape[-1]
    G, A_qk, KK, Tinv, W, U, K_d = _intra(q, k, v, g, beta, doc, A_log, dt_bias, scale, g_min)
    if not keep:
        del KK, Tinv  # not held through the scan unless kept
    h_states, v_new, final = _scan(K_d, G, W, U, doc, initial_state, output_final_state,
                                   seq_len, _operand(q))
    del U  # read by the scan only: V~ replaces it
    o = torch.empty(batch, seq_len, heads, d_v, device=q.device, dtype=q.dtype)
    block_k, block_v, _ = _blocks(d_k, d_v)
    wrap_triton(chunk_output_kernel)[(triton.cdiv(seq_len, CHUNK), batch * heads)](
        q, G, A_qk, h_states, v_new, doc, o, scale, seq_len,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        OPERAND=_operand(q), num_warps=NUM_WARPS["chunk_output_kernel"],
    )  # fmt: skip
    return o, final, (A_qk, KK, Tinv, G, W, K_d, h_states, v_new) if keep else None


def _final_state(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, scale, g_min):
    """The state after one segment, by the forward's kernels up to the scan (no output)."""
    G, _, _, _, W, U, K_d = _intra(q, k, v, g, beta, doc, A_log, dt_bias, scale, g_min)
    return _scan(K_d, G, W, U, doc, initial_state, True, q.shape[1], _operand(q))[2]


def _segments(seq_len: int) -> list[tuple[int, int]]:
    return [(start, min(start + SEGMENT, seq_len)) for start in range(0, seq_len, SEGMENT)]


def _tokens(x: Tensor | None, start: int, end: int) -> Tensor | None:
    """Tokens [start, end) of a [B, T, ...] tensor, contiguous as the kernels index it."""
    return None if x is None else x[:, start:end].contiguous()


def _entering(state: Tensor | None, doc: Tensor | None, start: int) -> Tensor | None:
    """The state (or its gradient) passed across the segment boundary at `start`: zero in the
    rows where a document begins there, whose state restarts."""
    if state is None or doc is None or start == 0:
        return state
    same = (doc[:, start] == doc[:, start - 1]).view(-1, 1, 1, 1)
    return torch.where(same, state, torch.zeros_like(state))


@triton_op("titan_moe::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    scale: float,
    g_min: float,
    output_final_state: bool,
    keep: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o [B,T,H,V] in q's dtype, final state [B,H,K,V] fp32, empty unless asked for, and with
    `keep` the KEPT buffers for the backward, which then runs none of the forward's kernels;
    empty when not kept or when the sequence runs by segments, whose backward recomputes them
    one segment at a time)."""
    seq_len = q.shape[1]
    kept = None
    if seq_len <= SEGMENT:
        o, final, kept = _forward_segment(q, k, v, g, beta, doc, A_log, dt_bias, initial_state,
                                          scale, g_min, output_final_state, keep)
    else:
        o = torch.empty(*q.shape[:3], v.shape[-1], device=q.device, dtype=q.dtype)
        final = initial_state
        for start, end in _segments(seq_len):
            rows = [_tokens(x, start, end) for x in (q, k, v, g, beta, doc)]
            o[:, start:end], final, _ = _forward_segment(
                *rows, A_log, dt_bias, _entering(final, doc, start), scale, g_min, True)
        final = final if output_final_state else None
    empties = [q.new_empty(0, dtype=torch.float32) for _ in range(1 + len(KEPT))]  # never alias
    return (o, final if final is not None else empties[0], *(kept or empties[1:]))


def _state_grads(q, G, A_qk, K_d, W, doc, do, d_final, initial_state, scale):
    """chunk_output_bwd, then the reverse scan: (dh_states in the scans' operand dtype, dV~
    fp32, d initial_state or None)."""
    batch, seq_len, heads, d_k = q.shape
    d_v = do.shape[-1]
    n_chunks = triton.cdiv(seq_len, CHUNK)
    block_k, block_v, _ = _blocks(d_k, d_v)
    f32 = dict(device=q.device, dtype=torch.float32)
    # The state gradients are stored in the scans' operand dtype (bf16 for bf16 inputs: 512 B a
    # token and head at K = V = 128, fp32's 1,024, on each of four passes: chunk_output_bwd's
    # write, the scan's read and rewrite, the state terms' read); state_scan.py says what that
    # costs. dV~ stays fp32.
    dh_states = torch.empty(batch, n_chunks, heads, d_k, d_v, device=q.device, dtype=W.dtype)
    dv_new = torch.empty(batch, G.shape[1], heads, d_v, **f32)
    d_initial = torch.empty_like(initial_state) if initial_state is not None else None
    wrap_triton(chunk_output_bwd_kernel)[(n_chunks, batch * heads)](
        q, G, A_qk, doc, do, dh_states, dv_new, scale, seq_len,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        OPERAND=_operand(q), num_warps=NUM_WARPS["chunk_output_bwd_kernel"],
    )  # fmt: skip
    wrap_triton(state_scan_bwd_kernel)[(triton.cdiv(d_v, block_v), batch * heads)](
        K_d, G, W, doc, d_final, dh_states, dv_new, d_initial, seq_len,
        H=heads, K=d_k, V=d_v, BK=block_k, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        HAS_D_FINAL=d_final is not None, STORE_D_INITIAL=d_initial is not None,
        OPERAND=_operand(q), INTERPRETED=triton.knobs.runtime.interpret, STAGES=SCAN_STAGES,
        num_warps=NUM_WARPS["state_scan_bwd_kernel"],
    )  # fmt: skip
    return dh_states, dv_new, d_initial


def _state_terms_grads(q, do, v_new, dv_new, h_states, dh_states, doc):
    """state_terms_bwd: the gradients of Q_g, W, K_d ([B,Tp,H,K] fp32) and of the chunks' gate
    totals ([B,NC,H,K] fp32)."""
    batch, seq_len, heads, d_k = q.shape
    d_v = do.shape[-1]
    n_chunks = triton.cdiv(seq_len, CHUNK)
    _, block_v, block = _blocks(d_k, d_v)
    f32 = dict(device=q.device, dtype=torch.float32)
    d_qg, d_w, d_kd = (torch.empty(batch, v_new.shape[1], heads, d_k, **f32) for _ in range(3))
    d_gamma = torch.empty(batch, n_chunks, heads, d_k, **f32)
    wrap_triton(state_terms_bwd_kernel)[(triton.cdiv(d_k, block), n_chunks, batch * heads)](
        do, v_new, dv_new, h_states, dh_states, doc, d_qg, d_w, d_kd, d_gamma, seq_len,
        H=heads, K=d_k, V=d_v, BK=block, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        OPERAND=_operand(q), num_warps=NUM_WARPS["state_terms_bwd_kernel"],
    )  # fmt: skip
    return d_qg, d_w, d_kd, d_gamma


def _intra_grads(q, k, v, g, beta, doc, A_log, dt_bias, G, KK, Tinv, v_new, dv_new, do, d_qg,
                 d_w, d_kd, d_gamma, scale, g_min):
    """ut_transform_bwd (adds to d_w in place), tile_products_bwd, gate_cumsum_bwd: (dq, dk, dv,
    dg in g's dtype, dbeta fp32, (dA_log, d_dt_bias) fp32 or None)."""
    batch, seq_len, heads, d_k = q.shape
    d_v = v.shape[-1]
    n_chunks = triton.cdiv(seq_len, CHUNK)
    _, block_v, block = _blocks(d_k, d_v)
    n_k_blocks = triton.cdiv(d_k, block)
    f32 = dict(device=q.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    dbeta = torch.empty(beta.shape, **f32)
    dA, dP = torch.empty_like(KK), torch.empty_like(KK)
    wrap_triton(ut_transform_bwd_kernel)[(n_chunks, batch * heads)](
        k, v, G, beta, doc, KK, Tinv, v_new, dv_new, do, d_w, dv, dbeta, dA, dP, seq_len,
        H=heads, K=d_k, V=d_v, BK=block, BV=block_v, C=CHUNK, HAS_DOCS=doc is not None,
        OPERAND=_operand(q), PRECISION=_precise(q),
        num_warps=NUM_WARPS["ut_transform_bwd_kernel"],
    )  # fmt: skip
    # dG is first written here: allocated after the states are let go, it stays off the peak.
    dq, dk, dG = torch.empty_like(q), torch.empty_like(k), torch.empty_like(G)
    d_end_parts = torch.empty(batch, n_chunks, CHUNK // SUBTILE, heads, d_k, **f32)
    wrap_triton(tile_products_bwd_kernel)[(CHUNK // SUBTILE * n_k_blocks, n_chunks,
                                          batch * heads)](
        q, k, G, doc, dA, dP, d_qg, d_w, d_kd, dq, dk, dG, d_end_parts, scale, seq_len,
        H=heads, K=d_k, BK=block, C=CHUNK, SUBTILE=SUBTILE, HAS_DOCS=doc is not None,
        PRECISION=_precise(q), INTERPRETED=triton.knobs.runtime.interpret,
        num_warps=NUM_WARPS["tile_products_bwd_kernel"],
        num_stages=NUM_STAGES["tile_products_bwd_kernel"],
    )  # fmt: skip
    del dA, dP
    dg = torch.empty_like(g)
    fused = A_log is not None
    d_gate_params = torch.empty(2, batch, n_chunks, heads, d_k, **f32) if fused else None
    wrap_triton(gate_cumsum_bwd_kernel)[(n_chunks, n_k_blocks, batch * heads)](
        g, A_log, dt_bias, G, d_end_parts, d_gamma, dG, doc, dg, d_gate_params, g_min, seq_len,
        H=heads, K=d_k, BK=block, C=CHUNK, TILES=CHUNK // SUBTILE, HAS_DOCS=doc is not None,
        FUSED_GATE=fused, num_warps=NUM_WARPS["gate_cumsum_bwd_kernel"],
    )  # fmt: skip
    gate_grads = None
    if fused:
        # Summed apart, so neither returned gradient is a view of the other's buffer.
        gate_grads = (d_gate_params[1].sum((0, 1, 3)), d_gate_params[0].sum((0, 1)).reshape(-1))
    return dq, dk, dv, dg, dbeta, gate_grads


def _backward_segment(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, do, d_final, scale,
                      g_min):
    """One segment's backward, recomputing what the forward did not keep: (dq, dk, dv, dg in
    g's dtype, dbeta fp32, d initial_state or None, (dA_log, d_dt_bias) fp32 or None)."""
    G, A_qk, KK, Tinv, W, U, K_d = _intra(q, k, v, g, beta, doc, A_log, dt_bias, scale, g_min)
    h_states, v_new, _ = _scan(K_d, G, W, U, doc, initial_state, False, q.shape[1],
                               _operand(q))
    # Each buffer is let go after the last kernel that reads it, so an eager backward holds only
    # the live ones at its peak (Inductor frees by last use on its own).
    del U
    dh_states, dv_new, d_initial = _state_grads(q, G, A_qk, K_d, W, doc, do, d_final,
                                                initial_state, scale)
    del A_qk, W, K_d
    d_qg, d_w, d_kd, d_gamma = _state_terms_grads(q, do, v_new, dv_new, h_states, dh_states, doc)
    del h_states, dh_states
    grads = _intra_grads(q, k, v, g, beta, doc, A_log, dt_bias, G, KK, Tinv, v_new, dv_new, do,
                         d_qg, d_w, d_kd, d_gamma, scale, g_min)
    return (*grads[:5], d_initial, grads[5])


@triton_op("titan_moe::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    do: Tensor,
    d_final: Tensor | None,
    scale: float,
    g_min: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward that recomputes the forward's buffers (the forward kept none, or the
    sequence runs by segments): (dq, dk, dv, dg in g's dtype, dbeta fp32, d initial_state fp32,
    dA_log fp32 [H], d_dt_bias fp32 [H*K]; each of the last three empty without its input)."""
    seq_len = q.shape[1]
    if seq_len <= SEGMENT:
        grads = _backward_segment(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, do,
                                  d_final, scale, g_min)
    else:
        segments = _segments(seq_len)
        entering = [initial_state]  # the state entering each segment, zeroed where one begins
        for (start, end), (next_start, _) in zip(segments[:-1], segments[1:], strict=True):
            rows = [_tokens(x, start, end) for x in (q, k, v, g, beta, doc)]
            final = _final_state(*rows, A_log, dt_bias, entering[-1], scale, g_min)
            entering.append(_entering(final, doc, next_start))
        f32 = dict(device=q.device, dtype=torch.float32)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                 torch.empty_like(g), torch.empty(beta.shape, **f32))
        d_state = d_final
        gate_grads = None
        for (start, end), state in zip(reversed(segments), reversed(entering), strict=True):
            rows = [_tokens(x, start, end) for x in (q, k, v, g, beta, doc)]
            segment = _backward_segment(*rows, A_log, dt_bias, state, _tokens(do, start, end),
                                        d_state, scale, g_min)
            for whole, part in zip(grads, segment[:5], strict=True):
                whole[:, start:end] = part
            d_state = _entering(segment[5], doc, start)
            if segment[6] is not None:
                gate_grads = segment[6] if gate_grads is None else tuple(
                    total + part for total, part in zip(gate_grads, segment[6], strict=True))
            del segment, part  # not held through the next segment's backward
        grads = (*grads, d_state, gate_grads)
    empty = q.new_empty(0, dtype=torch.float32)
    d_initial = empty if grads[5] is None else grads[5]
    gate_grads = (empty.clone(), empty.clone()) if grads[6] is None else grads[6]
    return (*grads[:5], d_initial, *gate_grads)


# The backward from the forward's KEPT buffers runs as three ops, as each kernel group reads
# them: an op's arguments live until it returns, so the buffers the first (or second) group
# last reads are freed before the next runs, and the eager backward peaks no higher than the
# one that recomputed them and let each go after its last kernel.


@triton_op("titan_moe::chunk_kda_bwd_states", mutates_args=())
def chunk_kda_bwd_states(
    q: Tensor,
    G: Tensor,
    A_qk: Tensor,
    K_d: Tensor,
    W: Tensor,
    doc: Tensor | None,
    do: Tensor,
    d_final: Tensor | None,
    initial_state: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The kept backward's first ops, the last readers of A_qk, K_d and W: (dh_states in the
    scans' operand dtype, dV~ and d initial_state fp32, the last empty without
    initial_state)."""
    dh_states, dv_new, d_initial = _state_grads(q, G, A_qk, K_d, W, doc, do, d_final,
                                                initial_state, scale)
    if d_initial is None:
        d_initial = q.new_empty(0, dtype=torch.float32)
    return dh_states, dv_new, d_initial


@triton_op("titan_moe::chunk_kda_bwd_state_terms", mutates_args=())
def chunk_kda_bwd_state_terms(
    q: Tensor,
    do: Tensor,
    v_new: Tensor,
    dv_new: Tensor,
    h_states: Tensor,
    dh_states: Tensor,
    doc: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kept backward's state terms, the last reader of the states and their gradients:
    (d Q_g, d W, d K_d, d gamma), fp32."""
    return _state_terms_grads(q, do, v_new, dv_new, h_states, dh_states, doc)


@triton_op("titan_moe::chunk_kda_bwd_intra", mutates_args=("d_w",))
def chunk_kda_bwd_intra(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    G: Tensor,
    KK: Tensor,
    Tinv: Tensor,
    v_new: Tensor,
    dv_new: Tensor,
    do: Tensor,
    d_qg: Tensor,
    d_w: Tensor,
    d_kd: Tensor,
    d_gamma: Tensor,
    scale: float,
    g_min: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The kept backward's last ops (d_w gains the UT transform's part in place): (dq, dk, dv,
    dg in g's dtype, dbeta fp32, dA_log fp32 [H], d_dt_bias fp32 [H*K]; the last two empty
    without the fused gate)."""
    *grads, gate_grads = _intra_grads(q, k, v, g, beta, doc, A_log, dt_bias, G, KK, Tinv, v_new,
                                      dv_new, do, d_qg, d_w, d_kd, d_gamma, scale, g_min)
    if gate_grads is None:
        gate_grads = (q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32))
    return (*grads, *gate_grads)


def _kept_backward(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, do, d_final, scale,
                   g_min, kept: list[Tensor]):
    """chunk_kda_bwd's outputs from the forward's KEPT buffers, which `kept` hands over: it is
    emptied, so each buffer is freed after the op that last reads it."""
    A_qk, KK, Tinv, G, W, K_d, h_states, v_new = kept
    kept.clear()
    dh_states, dv_new, d_initial = chunk_kda_bwd_states(q, G, A_qk, K_d, W, doc, do, d_final,
                                                        initial_state, scale)
    del A_qk, K_d, W
    d_qg, d_w, d_kd, d_gamma = chunk_kda_bwd_state_terms(q, do, v_new, dv_new, h_states,
                                                         dh_states, doc)
    del h_states, dh_states
    *grads, dA_log, d_dt_bias = chunk_kda_bwd_intra(
        q, k, v, g, beta, doc, A_log, dt_bias, G, KK, Tinv, v_new, dv_new, do, d_qg, d_w, d_kd,
        d_gamma, scale, g_min)
    return (*grads, d_initial, dA_log, d_dt_bias)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, doc, A_log, dt_bias, initial_state, scale, g_min, _, _ = inputs
    kept = output[2:]
    ctx.mark_non_differentiable(*kept)
    # Autograd would otherwise hand the backward a zero gradient for every output without one,
    # the kept buffers included (marked non-differentiable or not): as many bytes as they hold,
    # filled, at the backward's start (2,560 B a token and head, 2.5 GiB at 64K x 16 heads).
    ctx.set_materialize_grads(False)
    kept = list(kept) if kept[0].numel() else []
    # Saved-tensor hooks (activation checkpointing, offloading) act on saved tensors only: under
    # them the kept buffers are saved, so a checkpoint drops them until its recompute. Otherwise
    # they go on the context, unsaved: the backward takes them off it and frees each after its
    # last reader (saved tensors live until the whole backward returns), and a second backward
    # through a retained graph finds none and recomputes.
    hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ctx.save_for_backward(q, k, v, g, beta, doc, A_log, dt_bias, initial_state,
                          *(kept if hooked else ()))
    ctx.kept = None if hooked or not kept else kept
    ctx.scale, ctx.g_min = scale, g_min


def _backward(ctx, do: Tensor | None, d_final: Tensor | None, *_kept_grads):
    q, k, v, g, beta, doc, A_log, dt_bias, initial_state, *saved = ctx.saved_tensors
    kept, ctx.kept = ctx.kept or saved or None, None
    if d_final is not None and d_final.numel() == 0:
        d_final = None
    if do is None:  # only the final state reaches the loss
        do = q.new_zeros(*q.shape[:3], v.shape[-1])
    args = (q, k, v, g, beta, doc, A_log, dt_bias, initial_state, do.contiguous(),
            None if d_final is None else d_final.contiguous(), ctx.scale, ctx.g_min)
    if kept is None:
        grads = chunk_kda_bwd(*args)
    else:
        grads = _kept_backward(*args, kept)
    dq, dk, dv, dg, dbeta, d_initial, dA_log, d_dt_bias = grads
    if A_log is None:
        dA_log = d_dt_bias = None
    else:
        dA_log, d_dt_bias = dA_log.to(A_log.dtype), d_dt_bias.to(dt_bias.dtype)
    return (dq, dk, dv, dg, dbeta.to(beta.dtype), None, dA_log, d_dt_bias,
            None if initial_state is None else d_initial.to(initial_state.dtype),
            None, None, None, None)


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    doc: Tensor | None = None,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    g_min: float = -5.0,
) -> tuple[Tensor, Tensor | None]:
    """q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; states [B,H,K,V]; doc [B,T] int32.

    `doc` gives each token's document (nondecreasing per row); the state restarts from zero at
    every change and initial_state seeds each row's first document. With A_log [H] and dt_bias
    [H*K], g is the raw gate input. Returns (o in q's dtype, final state fp32 or None).
    """
    validate_kda_inputs(q, k, v, g, beta, initial_state, None, doc, CHUNK)
    if (A_log is None) != (dt_bias is None):
        raise ValueError("give both A_log and dt_bias (the fused gate) or neither")
    if A_log is not None:
        validate_gate_params(q.shape[2], q.shape[3], A_log, dt_bias)
    d_k, d_v = q.shape[-1], v.shape[-1]
    if d_k > MAX_HEAD_DIM or d_v > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got K={d_k}, V={d_v}")
    scale = d_k**-0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    # A backward will run: keep the KEPT buffers for it (inference does not pay for them).
    grads = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias, initial_state)
    )
    o, final, *_ = chunk_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        None if doc is None else doc.to(torch.int32).contiguous(),
        None if A_log is None else A_log.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
        initial_state, float(scale), float(g_min), output_final_state, grads,
    )  # fmt: skip
    return o, final if output_final_state else None
