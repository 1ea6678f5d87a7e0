"""SiTU-GLU forward and backward as one elementwise Triton kernel each, for eager CUDA.

    forward   h  = SiTU_β1(a) · t(b),   SiTU_β(a) = β tanh(a/β) σ(a),   t(b) = β2 tanh(b/β2)
    backward  ∂a = ∂h · t(b) · [(1 − tanh²(a/β1)) σ(a) + SiTU_β1(a) (1 − σ(a))]
              ∂b = ∂h · SiTU_β1(a) · (1 − tanh²(b/β2))

Eagerly, `naive.situ_glu_naive` is about ten PyTorch kernels forward and fifteen backward, each
a pass over [rows, hidden] in fp32 (bench/moe.py, H100, 2026-12-05: 15 fp32 binary kernels
took 0.52 ms of one eager MoE f+b at d 512, and 2.7 ms at the proxy's shape). Here the forward
reads a and b and writes h (6 bytes an element in bf16), the backward reads ∂h, a and b and
writes ∂a and ∂b (10 bytes), everything else in registers in fp32; the forward saves a and b.
Compiled graphs do not take this op: Inductor fuses the reference's maths itself
(compile_passes/situ_glu_fusion.py), so the dispatcher (`titan_moe.ops.situ_glu`) sends them
there. Eager calls take `*_call` (`titan_moe.ops.direct_call`): the ops' bodies in an autograd
Function, without the dispatcher's round trips.

Packed (`titan_moe::situ_glu_packed`): the routed experts' first grouped GEMM writes a and b
side by side, ab [rows, 2H] = [a | b] (one GEMM against W1 and W3 stacked). The same kernels read
a and b from ab's two column halves and the backward writes ∂ab = [∂a | ∂b] in one tensor, so
neither direction copies the halves apart or back together.

tanh and σ are ops/libdevice_math.py's: libdevice's on CUDA; under Triton's interpreter (the CPU
tests) tanh comes from exp, exact to about 1e-7 absolute.
One program takes BLOCK elements of h, 4 warps, no autotuning. With h's rows H wide, element
(r, c) of a sits at r·STRIDE + c and b's B_COL columns further: packed, STRIDE = 2H and B_COL =
H, a and b the same pointer (one compile per hidden width); separate contiguous tensors pass
H = STRIDE = 1 and B_COL = 0, so element i of h reads a's and b's element i.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.direct_call import direct_call
from titan_moe.ops.libdevice_math import sigmoid, tanh

BLOCK, WARPS = 2048, 4


@triton.jit
def _input_offsets(offs, H: tl.constexpr, STRIDE: tl.constexpr):
    """Offsets of h's elements offs in a row-strided [rows, STRIDE] input."""
    if STRIDE == H:
        return offs
    return (offs // H) * STRIDE + offs % H


@triton.jit
def situ_glu_fwd_kernel(a_ptr, b_ptr, h_ptr, n, H: tl.constexpr, STRIDE: tl.constexpr,
                        B_COL: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr,
                        BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    at = _input_offsets(offs, H, STRIDE)
    a = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + at + B_COL, mask=mask, other=0.0).to(tl.float32)
    situ_a = BETA1 * tanh(a / BETA1, LIBDEVICE) * sigmoid(a, LIBDEVICE)
    h = situ_a * (BETA2 * tanh(b / BETA2, LIBDEVICE))
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, H: tl.constexpr,
                        STRIDE: tl.constexpr, B_COL: tl.constexpr, BETA1: tl.constexpr,
                        BETA2: tl.constexpr, BLOCK: tl.constexpr,
                        LIBDEVICE: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    at = _input_offsets(offs, H, STRIDE)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + at + B_COL, mask=mask, other=0.0).to(tl.float32)
    tanh_a = tanh(a / BETA1, LIBDEVICE)
    sig_a = sigmoid(a, LIBDEVICE)
    tanh_b = tanh(b / BETA2, LIBDEVICE)
    situ_a = BETA1 * tanh_a * sig_a
    d_situ = (1.0 - tanh_a * tanh_a) * sig_a + situ_a * (1.0 - sig_a)
    da = dh * (BETA2 * tanh_b) * d_situ
    db = dh * situ_a * (1.0 - tanh_b * tanh_b)
    tl.store(da_ptr + at, da.to(da_ptr.dtype.element_ty), mask=mask)
    if B_COL == 0:
        tl.store(db_ptr + at, db.to(db_ptr.dtype.element_ty), mask=mask)
    else:  # packed: ∂b lies B_COL columns right of ∂a, in the one output (db_ptr is None)
        tl.store(da_ptr + at + B_COL, db.to(da_ptr.dtype.element_ty), mask=mask)


def validate_situ_glu_inputs(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")


def _launch_fwd(a: Tensor, b: Tensor, h: Tensor, hidden: int, stride: int, b_col: int,
                beta1: float, beta2: float) -> None:
    n = h.numel()
    wrap_triton(situ_glu_fwd_kernel)[(triton.cdiv(n, BLOCK),)](
        a, b, h, n, H=hidden, STRIDE=stride, B_COL=b_col, BETA1=beta1, BETA2=beta2, BLOCK=BLOCK,
        LIBDEVICE=a.is_cuda, num_warps=WARPS,
    )  # fmt: skip


def _launch_bwd(dh: Tensor, a: Tensor, b: Tensor, da: Tensor, db: Tensor | None, hidden: int,
                stride: int, b_col: int, beta1: float, beta2: float) -> None:
    n = dh.numel()
    wrap_triton(situ_glu_bwd_kernel)[(triton.cdiv(n, BLOCK),)](
        dh, a, b, da, db, n, H=hidden, STRIDE=stride, B_COL=b_col, BETA1=beta1, BETA2=beta2,
        BLOCK=BLOCK, LIBDEVICE=a.is_cuda, num_warps=WARPS,
    )  # fmt: skip


def _situ_glu(a: Tensor, b: Tensor, beta1: float, beta2: float) -> Tensor:
    """`naive.situ_glu_naive` in one kernel: a, b of one shape and dtype (fp32/bf16/fp16) ->
    h in a's dtype, computed in fp32."""
    validate_situ_glu_inputs(a, b)
    a, b = a.contiguous(), b.contiguous()
    h = torch.empty_like(a)
    _launch_fwd(a, b, h, 1, 1, 0, beta1, beta2)  # contiguous: element i of h is a's and b's i
    return h


def _situ_glu_bwd(
    dh: Tensor, a: Tensor, b: Tensor, beta1: float, beta2: float
) -> tuple[Tensor, Tensor]:
    """(∂a, ∂b) of `situ_glu_triton` given ∂h, in a's and b's dtypes."""
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    _launch_bwd(dh, a, b, da, db, 1, 1, 0, beta1, beta2)
    return da, db


situ_glu_triton = triton_op("titan_moe::situ_glu", mutates_args=())(_situ_glu)
situ_glu_bwd_triton = triton_op("titan_moe::situ_glu_bwd", mutates_args=())(_situ_glu_bwd)
situ_glu_bwd_call = direct_call(situ_glu_bwd_triton, _situ_glu_bwd)


def _setup_context(ctx, inputs, output) -> None:
    a, b, ctx.beta1, ctx.beta2 = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, dh: Tensor):
    a, b = ctx.saved_tensors
    da, db = situ_glu_bwd_call(dh, a, b, ctx.beta1, ctx.beta2)
    return da, db, None, None


situ_glu_triton.register_autograd(_backward, setup_context=_setup_context)
situ_glu_call = direct_call(situ_glu_triton, _situ_glu, _setup_context, _backward)


def validate_packed_input(ab: Tensor) -> None:
    if ab.ndim < 1 or ab.shape[-1] % 2:
        raise ValueError(f"ab must be [..., 2·hidden] (a and b side by side), got shape "
                         f"{tuple(ab.shape)}")


def _situ_glu_packed(ab: Tensor, beta1: float, beta2: float) -> Tensor:
    """`naive.situ_glu_packed_naive` in one kernel: ab [..., 2H] = [a | b] (fp32/bf16/fp16) ->
    h [..., H] in ab's dtype, computed in fp32."""
    validate_packed_input(ab)
    ab = ab.contiguous()
    hidden = ab.shape[-1] // 2
    h = ab.new_empty(*ab.shape[:-1], hidden)
    _launch_fwd(ab, ab, h, hidden, 2 * hidden, hidden, beta1, beta2)
    return h


def _situ_glu_packed_bwd(dh: Tensor, ab: Tensor, beta1: float, beta2: float) -> Tensor:
    """∂ab [..., 2H] = [∂a | ∂b] of `situ_glu_packed_triton` given ∂h, in ab's dtype."""
    dh, ab = dh.contiguous(), ab.contiguous()
    hidden = ab.shape[-1] // 2
    dab = torch.empty_like(ab)
    # dab goes in once: under torch.compile each written argument is cloned and written back
    # on its own, so dab passed as both ∂a and ∂b came back with one half unwritten (AOT
    # opcheck on an H100, 2026-12-07).
    _launch_bwd(dh, ab, ab, dab, None, hidden, 2 * hidden, hidden, beta1, beta2)
    return dab


situ_glu_packed_triton = triton_op("titan_moe::situ_glu_packed", mutates_args=())(
    _situ_glu_packed)
situ_glu_packed_bwd_triton = triton_op("titan_moe::situ_glu_packed_bwd", mutates_args=())(
    _situ_glu_packed_bwd)
situ_glu_packed_bwd_call = direct_call(situ_glu_packed_bwd_triton, _situ_glu_packed_bwd)


def _packed_setup_context(ctx, inputs, output) -> None:
    ab, ctx.beta1, ctx.beta2 = inputs
    ctx.save_for_backward(ab)


def _packed_backward(ctx, dh: Tensor):
    (ab,) = ctx.saved_tensors
    return situ_glu_packed_bwd_call(dh, ab, ctx.beta1, ctx.beta2), None, None


situ_glu_packed_triton.register_autograd(_packed_backward, setup_context=_packed_setup_context)
situ_glu_packed_call = direct_call(situ_glu_packed_triton, _situ_glu_packed,
                                   _packed_setup_context, _packed_backward)
