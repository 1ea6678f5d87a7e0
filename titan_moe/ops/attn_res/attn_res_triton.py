"""One Block-AttnRes site as two Triton kernels that read each source once (forward) and twice,
the second time from L2 (backward). The maths is `naive.attn_res_mix_naive`'s.

Forward (`attn_res_fwd_kernel`): a program takes BLOCK_ROWS rows with the whole d in one block
(BLOCK_D = next_power_of_2(d), masked) and walks the n sources once with an online softmax, as
flash attention does over keys: a running max m, denominator l and an fp32 accumulator
acc [BLOCK_ROWS, BLOCK_D]; source i gives r_i, s_i from one load, then

    m' = max(m, s_i);  acc = acc·exp(m - m') + exp(s_i - m')·V_i;  l = l·exp(m - m') + exp(s_i - m')

and out = acc / l. It writes out [rows, d] in the dtype asked for (the site asks for its
sources', so no fp32 copy of the output, nor of its gradient, exists: 8 GiB each at 1M tokens
and d = 2048) and stats [3, n, rows] fp32 (p, r, s) for the backward, n·12 bytes a row against
the 2–4·d·n bytes of the sources. The gradient comes back in out's dtype and is read as fp32.

Backward (`attn_res_bwd_kernel`): a fixed grid of PROGRAMS_PER_SM programs per SM, each looping
over row blocks. Pass 1 reads g and every V_i for dp_i = <g, V_i> (c = Σ p_j dp_j needs all of
them); pass 2 re-reads V_i (just read by the same program: L2-hot) and writes

    dV_i = p_i g + ds_i r_i u - (ds_i s_i r_i² / d) V_i,    ds_i = p_i (dp_i - c)

in V_i's dtype, adding Σ_rows ds_i r_i V_i into the program's du row. The du partials are a
[programs, d] fp32 buffer that PyTorch sums: deterministic, no atomics, and small (4 programs
an SM: 132·4·d·4 bytes, ~4 MB at d = 2048 against ~0.7 GB the backward moves for n = 9 at
8192 rows).

The sources are separate pointer arguments s0..s8 (None when unused), picked by a constexpr
index inside `tl.static_range(N)`: each keeps its own dtype, so a list of an fp32 embedding and
bf16 partial sums needs no cast or stack. They must have one shape and be contiguous (the op
makes them so); rows are all leading dims flattened.

Range and precision: every quantity is fp32. A row's sums run over d terms of bounded size
(V_i², V_i u, g V_i: fp32 products of bf16/fp32 inputs), whose relative rounding error grows
like sqrt(d)·2⁻²⁴ for the tree reductions Triton emits (≤ d·2⁻²⁴ ≈ 1e-4 worst case at d = 2048,
far inside bf16's 2⁻⁸ that the sources carry); mean(V²) + eps is ≥ eps > 0, so rsqrt is finite,
and fp32's range (1e±38) holds V² for any bf16/fp16/fp32 activation a model can use. The softmax
subtracts the running max, so every exp is ≤ 1 and l ∈ [1, n]; n ≤ 9 weighted terms add at most
n·2⁻²⁴ relative error to out. A bf16 source's gradient is rounded to bf16 once, at the store.

`titan_moe::attn_res_fwd` and `titan_moe::attn_res_bwd` are `torch.library.triton_op`s (with a
`list[Tensor]` argument, which triton_op takes like any custom op: the list is one Tensor[]
schema argument, and the body passes its elements to the kernel one by one), so torch.compile
sees the kernels; autograd is registered on the forward op, whose second output (the stats) is
for the backward only. Inductor cannot compile user Triton kernels for CPU tensors: callers
branch on the device (`titan_moe.ops.attn_res.attn_res_mix`); tests run the kernels on CPU
under TRITON_INTERPRET=1. On CUDA the model's sites no longer contain the stacked graph that
compile_passes/attn_res_fusion.py matches, so that pass only fires on CPU graphs.

Where this departs from the plain design: the forward op returns (out, stats), not out alone,
because register_autograd's setup_context sees only an op's inputs and outputs and the backward
needs p, r, s (`attn_res_mix_triton` returns out); s is saved, not recomputed from <V_i, u>,
as it costs 4 bytes a row and source. The backward op takes u = γ ⊙ w and returns du; dγ, dw
are PyTorch products in the autograd function. The backward's row loop is a while loop (same
code compiled; see the kernel).
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.attn_res.naive import MAX_SOURCES, validate_attn_res_inputs

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# BLOCK_ROWS * BLOCK_D of a program's tile, from a tile sweep on the H200 (2026-12-04, rows 8192,
# d 2048, n = 2 / 5 / 9, source 0 fp32, the rest bf16; bench/RESULTS.md). Forward: the program's
# n source tiles together hold about FWD_ROW_ELEMENTS (n = 2: 2 rows, n ≥ 3: 1 row at d = 2048;
# 4 warps): 0.113 / 0.170 / 0.275 ms against 0.122 / 0.268 / 0.323 ms for 4 rows and 8 warps
# whatever n. Backward: 2 rows, 4 warps, 4 programs an SM: 0.17 / 0.26 / 0.47 ms against
# 0.16 / 0.34 / 0.58 ms for 8 warps and 2 programs an SM.
FWD_ROW_ELEMENTS = 8192
BWD_ROW_ELEMENTS = 4096
MAX_BLOCK_ROWS = 8
PROGRAMS_PER_SM = 4  # the backward's persistent grid; CPU (interpreter) runs use CPU_PROGRAMS
CPU_PROGRAMS = 2


@triton.jit
def _pick(INDEX: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, p8):
    """The INDEX-th pointer: a compile-time choice, so each keeps its own element type."""
    if INDEX == 0:
        ptr = p0
    elif INDEX == 1:
        ptr = p1
    elif INDEX == 2:
        ptr = p2
    elif INDEX == 3:
        ptr = p3
    elif INDEX == 4:
        ptr = p4
    elif INDEX == 5:
        ptr = p5
    elif INDEX == 6:
        ptr = p6
    elif INDEX == 7:
        ptr = p7
    else:
        ptr = p8
    return ptr


@triton.jit
def attn_res_fwd_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7, s8, u_ptr, out_ptr, stats_ptr,
    n_rows, eps,
    N: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32).
    eps = tl.cast(eps, tl.float32)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    slots = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < D
    in_tile = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    u = tl.load(u_ptr + cols, mask=col_ok, other=0.0)

    m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    r_all = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    s_all = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(N):
        src = _pick(i, s0, s1, s2, s3, s4, s5, s6, s7, s8)
        v = tl.load(src + offs, mask=in_tile, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        s = r * tl.sum(v * u[None, :], axis=1)
        m_new = tl.maximum(m, s)
        scale = tl.exp(m - m_new)  # 0 at the first source (m = -inf)
        e = tl.exp(s - m_new)
        acc = acc * scale[:, None] + e[:, None] * v
        denom = denom * scale + e
        m = m_new
        r_all = tl.where(slots[None, :] == i, r[:, None], r_all)
        s_all = tl.where(slots[None, :] == i, s[:, None], s_all)

    tl.store(out_ptr + offs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=in_tile)
    p_all = tl.exp(s_all - m[:, None]) / denom[:, None]
    stat_offs = slots[None, :].to(tl.int64) * n_rows + rows[:, None]
    stat_ok = row_ok[:, None] & (slots[None, :] < N)
    plane = N * n_rows  # stats is [3, N, rows]: p, r, s
    tl.store(stats_ptr + stat_offs, p_all, mask=stat_ok)
    tl.store(stats_ptr + plane + stat_offs, r_all, mask=stat_ok)
    tl.store(stats_ptr + 2 * plane + stat_offs, s_all, mask=stat_ok)


@triton.jit
def attn_res_bwd_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7, s8, d0, d1, d2, d3, d4, d5, d6, d7, d8,
    u_ptr, grad_ptr, stats_ptr, du_ptr, n_rows, n_blocks, n_programs,
    N: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr = 0,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    slots = tl.arange(0, BLOCK_N)
    col_ok = cols < D
    u = tl.load(u_ptr + cols, mask=col_ok, other=0.0)
    du = tl.zeros([BLOCK_D], dtype=tl.float32)
    plane = N * n_rows
    # Blocks pid, pid + n_programs, ... (n_programs = the grid). A while loop, not
    # range(pid, n_blocks, n_programs): Triton's interpreter holds scalars as 1-element arrays,
    # which range() cannot take under NumPy 2 (the compiled kernel is the same loop either way).
    block = pid
    while block < n_blocks:
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n_rows
        in_tile = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        g = tl.load(grad_ptr + offs, mask=in_tile, other=0.0).to(tl.float32)
        stat_offs = slots[None, :].to(tl.int64) * n_rows + rows[:, None]
        stat_ok = row_ok[:, None] & (slots[None, :] < N)
        p_all = tl.load(stats_ptr + stat_offs, mask=stat_ok, other=0.0)

        # Pass 1: dp_i = <g, V_i> for every source, then c = Σ p_i dp_i.
        dp_all = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(N):
            src = _pick(i, s0, s1, s2, s3, s4, s5, s6, s7, s8)
            v = tl.load(src + offs, mask=in_tile, other=0.0).to(tl.float32)
            dp = tl.sum(g * v, axis=1)
            dp_all = tl.where(slots[None, :] == i, dp[:, None], dp_all)
        c = tl.sum(p_all * dp_all, axis=1)
        ds_all = p_all * (dp_all - c[:, None])

        # Pass 2: V_i again (L2-hot), dV_i in V_i's dtype, and the du partial.
        for i in tl.static_range(N):
            src = _pick(i, s0, s1, s2, s3, s4, s5, s6, s7, s8)
            dst = _pick(i, d0, d1, d2, d3, d4, d5, d6, d7, d8)
            v = tl.load(src + offs, mask=in_tile, other=0.0).to(tl.float32)
            p = tl.load(stats_ptr + i * n_rows + rows, mask=row_ok, other=0.0)
            r = tl.load(stats_ptr + plane + i * n_rows + rows, mask=row_ok, other=0.0)
            s = tl.load(stats_ptr + 2 * plane + i * n_rows + rows, mask=row_ok, other=0.0)
            ds = tl.sum(tl.where(slots[None, :] == i, ds_all, 0.0), axis=1)
            dsr = ds * r
            dv = p[:, None] * g + dsr[:, None] * u[None, :] - (dsr * s * r / D)[:, None] * v
            if (ACCUMULATE >> i) & 1:  # bit i: add into source i's gradient buffer
                dv += tl.load(dst + offs, mask=in_tile, other=0.0).to(tl.float32)
            tl.store(dst + offs, dv.to(dst.dtype.element_ty), mask=in_tile)
            du += tl.sum(dsr[:, None] * v, axis=0)
        block += n_programs
    tl.store(du_ptr + pid.to(tl.int64) * D + cols, du, mask=col_ok)


def _blocks(dim: int, row_elements: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_D, num_warps) for tiles of about row_elements (a power of two of rows
    of d elements, at least one)."""
    block_d = triton.next_power_of_2(dim)
    fit = max(1, min(MAX_BLOCK_ROWS, row_elements // block_d))
    block_rows = 1 << (fit.bit_length() - 1)  # tl.arange takes powers of two only
    tile = block_rows * block_d
    num_warps = 4 if tile <= 4096 else 8 if tile <= 8192 else 16
    return block_rows, block_d, num_warps


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _backward_programs(device: torch.device, n_blocks: int) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        available = PROGRAMS_PER_SM * _sm_count(index)
    else:
        available = CPU_PROGRAMS
    return max(1, min(n_blocks, available))


def _padded(tensors: list[Tensor]) -> list[Tensor | None]:
    return list(tensors) + [None] * (MAX_SOURCES - len(tensors))


def validate_triton_inputs(sources: list[Tensor], query: Tensor, gain: Tensor) -> None:
    validate_attn_res_inputs(sources, query, gain, MAX_SOURCES)
    for i, v in enumerate(sources):
        if v.dtype not in TRITON_DTYPES:
            raise ValueError(f"attn_res: the Triton op takes fp32/bf16/fp16 sources, source {i} "
                             f"is {v.dtype}")


def fused_query(query: Tensor, gain: Tensor) -> Tensor:
    """u = gain ⊙ query in fp32, contiguous, as the kernels read it (rounded as the reference
    rounds it)."""
    return (gain * query).float().contiguous()


def query_gain_grads(du: Tensor, query: Tensor, gain: Tensor) -> tuple[Tensor, Tensor]:
    """(d_query, d_gain) in their own dtypes, from du, the gradient of u = gain ⊙ query."""
    return (du * gain.float()).to(query.dtype), (du * query.float()).to(gain.dtype)


@triton_op("titan_moe::attn_res_fwd", mutates_args=())
def attn_res_fwd(
    sources: list[Tensor], query: Tensor, gain: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(out [..., d] in out_dtype, stats [3, n, rows] fp32: p, r, s for the backward).

    Sources: 1 ≤ n ≤ 9 tensors of one shape [..., d], each fp32, bf16 or fp16 (mixed is fine);
    query and gain [d]; out_dtype fp32, bf16 or fp16 (computed in fp32, rounded once)."""
    validate_triton_inputs(sources, query, gain)
    sources = [v.contiguous() for v in sources]
    n, dim = len(sources), int(sources[0].shape[-1])  # d is a kernel constant: specialised
    n_rows = sources[0].numel() // dim
    device = sources[0].device
    u = fused_query(query, gain)
    out = torch.empty(sources[0].shape, device=device, dtype=out_dtype)
    stats = torch.empty(3, n, n_rows, device=device, dtype=torch.float32)
    block_rows, block_d, num_warps = _blocks(dim, FWD_ROW_ELEMENTS // n)
    wrap_triton(attn_res_fwd_kernel)[(triton.cdiv(n_rows, block_rows),)](
        *_padded(sources), u, out, stats, n_rows, eps,
        N=n, D=dim, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps,
    )  # fmt: skip
    return out, stats


@triton_op("titan_moe::attn_res_bwd", mutates_args=())
def attn_res_bwd(
    sources: list[Tensor], stats: Tensor, u: Tensor, grad: Tensor
) -> list[Tensor]:
    """[dV_0, ..., dV_{n-1} (each in its source's dtype), du [d] fp32] for u = gain ⊙ query."""
    grads = [torch.empty_like(v) for v in sources]
    return grads + [_launch_backward(sources, stats, u, grad, grads, 0)]


def attn_res_bwd_into(
    sources: list[Tensor], stats: Tensor, u: Tensor, grad: Tensor, grads: list[Tensor],
    accumulate: list[bool],
) -> Tensor:
    """attn_res_bwd writing dV_i into grads[i] (added to what it holds where accumulate[i]);
    returns du [d] fp32. Eager only (it writes into its arguments): the gradient sinks'
    backward (model/attn_res_sink.py), where a block's gradient is summed in place over the
    sites that read it instead of returned by each."""
    mask = sum(1 << i for i, add in enumerate(accumulate) if add)
    return _launch_backward(sources, stats, u, grad.contiguous(), grads, mask)


def _launch_backward(sources: list[Tensor], stats: Tensor, u: Tensor, grad: Tensor,
                     grads: list[Tensor], accumulate: int) -> Tensor:
    n, dim = len(sources), int(sources[0].shape[-1])
    n_rows = sources[0].numel() // dim
    device = sources[0].device
    block_rows, block_d, num_warps = _blocks(dim, BWD_ROW_ELEMENTS)
    n_blocks = triton.cdiv(n_rows, block_rows)
    programs = _backward_programs(device, n_blocks)
    du_partial = torch.empty(programs, dim, device=device, dtype=torch.float32)
    wrap_triton(attn_res_bwd_kernel)[(programs,)](
        *_padded(sources), *_padded(grads), u, grad, stats, du_partial, n_rows, n_blocks, programs,
        N=n, D=dim, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        BLOCK_N=triton.next_power_of_2(n), ACCUMULATE=accumulate, num_warps=num_warps,
    )  # fmt: skip
    return du_partial.sum(0)


def _setup_context(ctx, inputs, output) -> None:
    sources, query, gain, _, _ = inputs
    _, stats = output
    ctx.n = len(sources)
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(*sources, stats, query, gain)


def _backward(ctx, grad_out: Tensor, _grad_stats: Tensor | None):
    *sources, stats, query, gain = ctx.saved_tensors
    sources = [v.contiguous() for v in sources]
    *grads, du = attn_res_bwd(sources, stats, fused_query(query, gain), grad_out.contiguous())
    return grads, *query_gain_grads(du, query, gain), None, None


attn_res_fwd.register_autograd(_backward, setup_context=_setup_context)


def attn_res_mix_triton(
    sources: list[Tensor], query: Tensor, gain: Tensor, eps: float,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`naive.attn_res_mix_naive` as the Triton op: [..., d] in out_dtype (fp32 by default)."""
    validate_triton_inputs(sources, query, gain)
    if out_dtype not in TRITON_DTYPES:
        raise ValueError(f"attn_res: out_dtype must be one of fp32/bf16/fp16, got {out_dtype}")
    out, _ = attn_res_fwd(list(sources), query, gain, float(eps), out_dtype)
    return out
