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
there.

tanh and σ are ops/libdevice_math.py's: libdevice's on CUDA; under Triton's interpreter (the CPU
tests) tanh comes from exp, exact to about 1e-7 absolute.
One program takes BLOCK contiguous elements, 4 warps, no autotuning.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.libdevice_math import sigmoid, tanh

BLOCK, WARPS = 2048, 4


@triton.jit
def situ_glu_fwd_kernel(a_ptr, b_ptr, h_ptr, n, BETA1: tl.constexpr, BETA2: tl.constexpr,
                        BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    situ_a = BETA1 * tanh(a / BETA1, LIBDEVICE) * sigmoid(a, LIBDEVICE)
    h = situ_a * (BETA2 * tanh(b / BETA2, LIBDEVICE))
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BETA1: tl.constexpr,
                        BETA2: tl.constexpr, BLOCK: tl.constexpr,
                        LIBDEVICE: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tanh_a = tanh(a / BETA1, LIBDEVICE)
    sig_a = sigmoid(a, LIBDEVICE)
    tanh_b = tanh(b / BETA2, LIBDEVICE)
    situ_a = BETA1 * tanh_a * sig_a
    d_situ = (1.0 - tanh_a * tanh_a) * sig_a + situ_a * (1.0 - sig_a)
    da = dh * (BETA2 * tanh_b) * d_situ
    db = dh * situ_a * (1.0 - tanh_b * tanh_b)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def validate_situ_glu_inputs(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")


@triton_op("titan_moe::situ_glu", mutates_args=())
def situ_glu_triton(a: Tensor, b: Tensor, beta1: float, beta2: float) -> Tensor:
    """`naive.situ_glu_naive` in one kernel: a, b of one shape and dtype (fp32/bf16/fp16) ->
    h in a's dtype, computed in fp32."""
    validate_situ_glu_inputs(a, b)
    a, b = a.contiguous(), b.contiguous()
    h = torch.empty_like(a)
    n = a.numel()
    wrap_triton(situ_glu_fwd_kernel)[(triton.cdiv(n, BLOCK),)](
        a, b, h, n, BETA1=beta1, BETA2=beta2, BLOCK=BLOCK, LIBDEVICE=a.is_cuda, num_warps=WARPS)
    return h


@triton_op("titan_moe::situ_glu_bwd", mutates_args=())
def situ_glu_bwd_triton(
    dh: Tensor, a: Tensor, b: Tensor, beta1: float, beta2: float
) -> tuple[Tensor, Tensor]:
    """(∂a, ∂b) of `situ_glu_triton` given ∂h, in a's and b's dtypes."""
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    wrap_triton(situ_glu_bwd_kernel)[(triton.cdiv(n, BLOCK),)](
        dh, a, b, da, db, n, BETA1=beta1, BETA2=beta2, BLOCK=BLOCK, LIBDEVICE=a.is_cuda,
        num_warps=WARPS)
    return da, db


def _setup_context(ctx, inputs, output) -> None:
    a, b, ctx.beta1, ctx.beta2 = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, dh: Tensor):
    a, b = ctx.saved_tensors
    da, db = situ_glu_bwd_triton(dh, a, b, ctx.beta1, ctx.beta2)
    return da, db, None, None


situ_glu_triton.register_autograd(_backward, setup_context=_setup_context)
