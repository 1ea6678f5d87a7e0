"""Sigmoid top-(k+1) routing and the QB histogram in one Triton pass over the logits.

One program takes whole rows of E scores and holds them in registers, one warp a program up to
E = 2048: a row's reductions are then single warp instructions (sm_80+ `redux`), none through
shared memory. (Eight warps over four rows, as before, paid two barriers a reduction: 136 a
program for sm_90 as launched, against one warp's 2, from layout conversions; bench/qb_route.py.)
    s = σ(logit);  key = order-preserving int32 of s + b
k+1 rounds each take the row max of the keys, the lowest expert index holding it (ties go to the
lower index), and knock that one key out; int32 keys need one min/max instruction an element
where int64 (value, index) pairs needed four. Rows of 512 to 1024 columns first keep each lane's
4 largest keys (four rounds over its 16 to 32) and run the k+1 rounds over those 32 x 4, about
a third fewer instructions at E 896 (`use_lane_top4`); a row where some lane held more of the
top k+1 (its 5th key not below the (k+1)-th, ties included) is picked again over every key, so
the result is the same. The k routed scores are re-read in one gather (L1-hot) and
summed left to right, so the weights are bit-equal to `naive.qb_route_naive`; the (k+1)-th max
decodes to alpha exactly, and each (token, expert) bin of r = alpha - s is counted with a
relaxed atomic add into [E, n_bins] int32, each routed slot into the [E] load. Nothing [T, E]
is written. Every program computes the histogram range [min(b) - 1, max(b) + 1] and its scale
n_bins / (hi - lo) from the bias row it loads anyway, as `histogram.qb_range` does (an exact
min and max, then IEEE fp32 subtraction and division), so bins are the reference's bit for bit
with no PyTorch kernels launched before the op's (they were five, with the stack).

Those atomics (14.7M at T 16384, E 896) cost 0.1 ms of the op's 0.251 ms on the H200 (graphed,
2026-12-05), and no Triton formulation counts cheaper (bench/qb_histogram_static.py, sm_90):
`tl.histogram` lowers to warp ballots at n_bins / 32 POPC an element, 32 and 119 SASS in all at
1000 bins (>= 112 us for 14.7M at 16 POPC a clock an SM); a one-hot int8 tensor-core product
takes 368 SASS an element (>= 161 us issue-bound); and summing equal (expert, bin) pairs before
the atomics leaves 99% of them over 8 tokens, 94% over 64, 42% over 1024, with no cheap way to
find the pairs. Counting in shared memory (atomics Triton does not expose) is
`counting="shared"`: the kernel writes each token's cutoff alpha (NaN where not counted) and
`bin_counts.count_bins`, a CUDA kernel built by NVRTC, bins and counts there from the logits.
On the H100 (2026-12-06, graphed, T 16384, E 896, k 16) that op takes 0.153 ms against the
atomics' 0.231 (count_bins alone 0.090). It costs a second launch, through a custom op and
torch's ctypes launcher: un-graphed, where the host issues each call, 0.488 ms against 0.333.
The shared count saves device time and spends host time, so it pays where the step is
device-bound and the host's extra time overlaps the GPU's work. The default
(`default_counting`) takes it from SHARED_COUNTING_MIN_COUNTS (token, expert) pairs: K3's 896
experts route 7.3M from 8,192 tokens a rank, in a device-bound step. Below that it keeps the
atomics, which cost little device time there (about 11 ns a thousand pairs), in steps small
enough to be host-bound (bench/moe.py's d 512 layer routes 2.1M pairs).

σ is ops/libdevice_math.py's: on CUDA the expression and functions torch.sigmoid's CUDA kernel
uses; under Triton's interpreter (tests) NumPy's exp, whose last bit can differ from torch's.

`titan_moe::qb_route` is a `torch.library.triton_op` (torch.compile sees the kernel); its
backward, the gradient of the weights w.r.t. the logits, is one more Triton op
(`route_weights_grad_triton.py`) that writes the dense [T, E] gradient from the k routed slots.
Eager calls take `qb_route_call`, the same body without the dispatcher
(`titan_moe.ops.direct_call`).
Inductor cannot compile user Triton kernels for CPU tensors: callers branch on the device
(`titan_moe.ops.router.qb_route`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.direct_call import direct_call
from titan_moe.ops.libdevice_math import sigmoid
from titan_moe.ops.router.bin_counts import MAX_BINS, count_bins, shared_counting_available
from titan_moe.ops.router.route_weights_grad_triton import route_weights_grad_call

WARP_ROW_ELEMENTS = 2048  # the longest row one warp holds: 64 keys a lane, no spills at sm_90
MAX_EXPERTS = 32 * WARP_ROW_ELEMENTS  # a row in 32 warps (1024 threads, CUDA's most a block)
COUNTING = ("atomic", "shared")  # how the histogram is counted, see launch_qb_route
# T x E from which the default counts in shared memory (module docstring): the device time it
# saves, 0.078 ms at 14.7M pairs (H100), is about 0.02 ms here.
SHARED_COUNTING_MIN_COUNTS = 1 << 22
KNOCKED_OUT: tl.constexpr = tl.constexpr(-(2**31))  # below every key of a real score


@triton.jit
def _order_key(v):
    """fp32 -> int32 with the same order (negative floats get their magnitude bits flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The inverse of _order_key."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _picks(key, cols, slots, K: tl.constexpr, BLOCK_K: tl.constexpr,
           NO_COLUMN: tl.constexpr):
    """K rounds over keys [BLOCK_T, N] of columns cols (broadcast to them): the row max, the
    lowest column holding it, that key knocked out. -> (ids [BLOCK_T, BLOCK_K] int64, the
    (k+1)-th max key). No pointer enters (Inductor's write analysis of the kernel traces the
    atomics' addresses, load + ids, back through a call's arguments)."""
    ids = tl.zeros([key.shape[0], BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, axis=1)
        e = tl.min(tl.where(key == best[:, None], cols, NO_COLUMN), axis=1)
        ids = tl.where(slots[None, :] == j, e[:, None], ids)
        key = tl.where(cols == e[:, None], KNOCKED_OUT, key)
    return ids, tl.max(key, axis=1)


@triton.jit
def _lane_max(key4, col4, NO_COLUMN: tl.constexpr):
    """Each lane's largest key of key4 [BLOCK_T, V, 32, 4] (lane = dim 2), its lowest column on
    ties, and key4 with it knocked out."""
    m = tl.max(tl.max(key4, axis=3), axis=1)
    at = tl.min(tl.min(tl.where(key4 == m[:, None, :, None], col4, NO_COLUMN), axis=3), axis=1)
    return m, at, tl.where(col4 == at[:, None, :, None], KNOCKED_OUT, key4)


@triton.jit
def _picks_of_four(k0, c0, k1, c1, k2, c2, k3, c3, slots, K: tl.constexpr,
                   BLOCK_K: tl.constexpr, NO_COLUMN: tl.constexpr):
    """_picks over four [BLOCK_T, 32] key and column arrays, as one of 128 columns a row."""
    ids = tl.zeros([k0.shape[0], BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)), axis=1)[:, None]
        e = tl.min(tl.minimum(
            tl.minimum(tl.where(k0 == best, c0, NO_COLUMN), tl.where(k1 == best, c1, NO_COLUMN)),
            tl.minimum(tl.where(k2 == best, c2, NO_COLUMN), tl.where(k3 == best, c3, NO_COLUMN))),
            axis=1)
        ids = tl.where(slots[None, :] == j, e[:, None], ids)
        k0 = tl.where(c0 == e[:, None], KNOCKED_OUT, k0)
        k1 = tl.where(c1 == e[:, None], KNOCKED_OUT, k1)
        k2 = tl.where(c2 == e[:, None], KNOCKED_OUT, k2)
        k3 = tl.where(c3 == e[:, None], KNOCKED_OUT, k3)
    top = tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3))
    return ids, tl.max(top, axis=1)


@triton.jit
def qb_route_kernel(
    logits_ptr, bias_ptr, valid_ptr, ids_ptr, weights_ptr, hist_ptr, alpha_ptr,
    load_ptr, n_tokens, stride_t, route_scale,
    E: tl.constexpr, K: tl.constexpr, N_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_VALID: tl.constexpr, WITH_HIST: tl.constexpr, WRITE_ALPHA: tl.constexpr,
    LIBDEVICE: tl.constexpr, LANE_TOP4: tl.constexpr,
):  # fmt: skip
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, the weights
    # would be computed in fp64 and rounded once, not bit-equal to the fp32 reference.
    route_scale = tl.cast(route_scale, tl.float32)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    row_ok = rows < n_tokens
    col_ok = cols < E
    in_tile = row_ok[:, None] & col_ok[None, :]
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_t
    x = tl.load(row_ptr[:, None] + cols[None, :], mask=in_tile, other=0.0).to(tl.float32)
    s = sigmoid(x, LIBDEVICE)
    b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    # s > 0, so s + b is never -0.0 and the int order equals the float order.
    key = tl.where(in_tile, _order_key(s + b[None, :]), KNOCKED_OUT)

    if LANE_TOP4:
        # Each lane's 4 largest keys (of the columns it loaded, 4 a vector), then the K picks
        # over the warp's 32 x 4: exact unless some lane held more of the top k + 1, i.e. its
        # next key is not below the (k+1)-th (ties included); then the row is picked again over
        # every key. The four stay apart, in the layout their reductions give (stacking them
        # cost a shared-memory layout conversion each, sm_90 SASS).
        key4 = tl.reshape(key, [BLOCK_T, BLOCK_E // 128, 32, 4])
        col4 = tl.reshape(cols, [BLOCK_E // 128, 32, 4])[None, :, :, :]
        k0, c0, key4 = _lane_max(key4, col4, BLOCK_E)
        k1, c1, key4 = _lane_max(key4, col4, BLOCK_E)
        k2, c2, key4 = _lane_max(key4, col4, BLOCK_E)
        k3, c3, key4 = _lane_max(key4, col4, BLOCK_E)
        rest = tl.max(tl.max(tl.max(key4, axis=3), axis=1), axis=1)
        ids, next_key = _picks_of_four(k0, c0, k1, c1, k2, c2, k3, c3, slots, K, BLOCK_K,
                                       BLOCK_E)
        if tl.max((row_ok & (rest >= next_key)).to(tl.int32), axis=0) > 0:
            ids, next_key = _picks(key, cols[None, :], slots, K, BLOCK_K, BLOCK_E)
    else:
        ids, next_key = _picks(key, cols[None, :], slots, K, BLOCK_K, BLOCK_E)

    slot_ok = row_ok[:, None] & (slots[None, :] < K)
    # The k routed scores re-read in one gather and summed left to right, as the reference
    # does (each term a masked row sum of one nonzero: exact).
    chosen = sigmoid(tl.load(row_ptr[:, None] + ids, mask=slot_ok, other=0.0).to(tl.float32),
                     LIBDEVICE)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        total += tl.sum(tl.where(slots[None, :] == j, chosen, 0.0), axis=1)
    out_offs = rows.to(tl.int64)[:, None] * K + slots[None, :]
    weights = tl.math.div_rn(chosen, total[:, None]) * route_scale
    tl.store(ids_ptr + out_offs, ids, mask=slot_ok)
    tl.store(weights_ptr + out_offs, weights, mask=slot_ok)

    if WITH_HIST:
        counted = row_ok
        if HAS_VALID:
            counted = counted & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
        # Rows past T hold only knocked-out keys, which decode to NaN: give them a number.
        alpha = tl.where(row_ok, _key_value(next_key), 0.0)
        if WRITE_ALPHA:  # counted by bin_counts.count_bins; NaN marks a token not counted
            tl.store(alpha_ptr + rows, tl.where(counted, alpha, float("nan")), mask=row_ok)
        else:
            lo = tl.min(tl.where(col_ok, b, float("inf")), axis=0) - 1.0
            hi = tl.max(tl.where(col_ok, b, float("-inf")), axis=0) + 1.0
            span = hi - lo
            scale = tl.math.div_rn(tl.full(span.shape, N_BINS, tl.float32), span)
            r = alpha[:, None] - s
            bins = tl.minimum(tl.maximum(tl.floor((r - lo) * scale), 0.0),
                              N_BINS - 1).to(tl.int32)
            hist_offs = cols[None, :] * N_BINS + bins
            tl.atomic_add(hist_ptr + hist_offs, 1, mask=counted[:, None] & col_ok[None, :],
                          sem="relaxed")
        tl.atomic_add(load_ptr + ids, 1, mask=slot_ok & counted[:, None], sem="relaxed")


def launch_shape(n_experts: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps): 32 keys a lane for short rows (many rows a warp, e.g. 16 at
    E = 64), one row a warp up to WARP_ROW_ELEMENTS, more warps a row only beyond."""
    block_e = triton.next_power_of_2(n_experts)
    num_warps = min(32, max(1, block_e // WARP_ROW_ELEMENTS))
    return max(1, 1024 // block_e), block_e, num_warps


def use_lane_top4(block_e: int) -> bool:
    """Rows of 512 or 1024 columns (16 or 32 keys a lane). sm_90, T 16384, E 896, k 16, fp32
    logits (ptxas, Triton 3.6): 3,072 SASS a row where no lane holds more than 4 of the top 17,
    against the picks over every key's 4,640 (2,264 against 3,784 without the histogram); 197
    registers uncapped, 168 with no spill under maxnreg 168 (the plain picks take 168). At 2,048
    columns it spills. Measured (H100, graphed, 2026-12-06) it is no faster with the histogram:
    0.233 ms against 0.226 over every key, both bound by the counting (0.078 without it)."""
    return 512 <= block_e <= 1024


def validate_route_inputs(logits: Tensor, bias: Tensor, top_k: int, valid: Tensor | None) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    n_tokens, n_experts = logits.shape
    if not 0 < top_k < n_experts:
        raise ValueError(f"need 0 < top_k < E, got top_k={top_k}, E={n_experts}")
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"the routing kernel supports E <= {MAX_EXPERTS}, got E={n_experts}")
    if bias.shape != (n_experts,):
        raise ValueError(f"bias must be [E]=[{n_experts}], got {tuple(bias.shape)}")
    if valid is not None and valid.shape != (n_tokens,):
        raise ValueError(f"valid must be [T]=[{n_tokens}], got {tuple(valid.shape)}")


def default_counting(logits: Tensor, n_bins: int) -> str:
    """"shared" from SHARED_COUNTING_MIN_COUNTS (token, expert) pairs where `count_bins` has its
    shared-memory kernel (CUDA, NVRTC), else "atomic"."""
    n_tokens, n_experts = logits.shape
    if n_tokens * n_experts >= SHARED_COUNTING_MIN_COUNTS and shared_counting_available(
            logits.device, n_bins, logits.dtype):
        return "shared"
    return "atomic"


def launch_qb_route(
    logits: Tensor,
    bias: Tensor,
    valid: Tensor | None,
    top_k: int,
    route_scale: float,
    n_bins: int,
    with_histogram: bool,
    block_t_and_warps: tuple[int, int] | None = None,
    maxnreg: int | None = None,
    counting: str | None = None,
    lane_top4: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's body: one kernel launch, at `launch_shape` unless (BLOCK_T, num_warps) is given,
    with ptxas's own register count unless `maxnreg` caps it (bench/qb_route.py compares launch
    shapes and caps; every one gives the same bits).

    counting: how the histogram is counted. "atomic": relaxed global atomics in the kernel;
    "shared": the kernel writes each token's cutoff and `count_bins` bins and counts them (in
    shared memory on CUDA where NVRTC builds its kernel); None: `default_counting`.

    lane_top4: pick among each lane's 4 largest keys first (the picks redone over every key
    where that is not exact); None: `use_lane_top4`. Both give the same bits.
    """
    validate_route_inputs(logits, bias, top_k, valid)
    if counting is None:
        counting = default_counting(logits, n_bins)
    if counting not in COUNTING:
        raise ValueError(f"counting must be one of {COUNTING}, got {counting!r}")
    if counting == "shared" and not 0 < n_bins <= MAX_BINS:
        raise ValueError(f"counting 'shared' needs 0 < n_bins <= {MAX_BINS}, got {n_bins}")
    logits = logits.contiguous()
    n_tokens, n_experts = logits.shape
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    n_hist = n_experts if with_histogram else 0
    write_alpha = with_histogram and counting == "shared"
    hist = alpha = None
    if write_alpha:
        alpha = torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    else:
        hist = torch.zeros(n_hist, n_bins, dtype=torch.int32, device=logits.device)
    load = torch.zeros(n_hist, dtype=torch.int32, device=logits.device)
    block_t, block_e, num_warps = launch_shape(n_experts)
    if block_t_and_warps is not None:
        block_t, num_warps = block_t_and_warps
    if lane_top4 is None:
        lane_top4 = use_lane_top4(block_e)
    if lane_top4 and block_e < 128:
        raise ValueError(f"lane_top4 needs E > 64 (128 columns a row block), got E={n_experts}")
    bias = bias.float().contiguous()
    wrap_triton(qb_route_kernel)[(triton.cdiv(n_tokens, block_t),)](
        logits, bias, valid, ids, weights, hist, alpha, load,
        n_tokens, logits.stride(0), route_scale,
        E=n_experts, K=top_k, N_BINS=n_bins, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), HAS_VALID=valid is not None,
        WITH_HIST=with_histogram, WRITE_ALPHA=write_alpha, LIBDEVICE=logits.is_cuda,
        LANE_TOP4=lane_top4, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    if write_alpha:
        hist = count_bins(logits, bias, alpha, n_bins)
    return ids, weights, hist, load


def _qb_route(
    logits: Tensor,
    bias: Tensor,
    valid: Tensor | None,
    top_k: int,
    route_scale: float,
    n_bins: int,
    with_histogram: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`naive.qb_route_naive` in one kernel: logits [T, E] (fp32/bf16/fp16) -> ids [T, k] int64,
    weights [T, k] fp32, hist [E, n_bins] int32, load [E] int32 (0 rows without histogram)."""
    return launch_qb_route(logits, bias, valid, top_k, route_scale, n_bins, with_histogram)


def _setup_context(ctx, inputs, output) -> None:
    logits, _, _, _, route_scale, _, _ = inputs
    ids = output[0]
    # Only the k routed logits of a row carry gradient; keeping them, not [T, E], is enough.
    ctx.save_for_backward(ids, logits.gather(-1, ids))
    ctx.route_scale = route_scale
    ctx.n_experts = logits.shape[-1]


def _backward(ctx, grad_ids, grad_weights, grad_hist, grad_load):
    """∂L/∂logits from ∂L/∂weights, one kernel (route_weights_grad_triton.py has the maths)."""
    ids, chosen_logits = ctx.saved_tensors
    grad_logits = route_weights_grad_call(ids, chosen_logits, grad_weights, ctx.route_scale,
                                          ctx.n_experts)
    return grad_logits, None, None, None, None, None, None


qb_route_triton = triton_op("titan_moe::qb_route", mutates_args={})(_qb_route)
qb_route_triton.register_autograd(_backward, setup_context=_setup_context)
qb_route_call = direct_call(qb_route_triton, _qb_route, _setup_context, _backward)
