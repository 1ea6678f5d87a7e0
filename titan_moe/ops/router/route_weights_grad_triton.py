"""The gradient of the routing weights w.r.t. the logits, as one Triton kernel.

The weights are p_j = ρ s_j / S over a token's k routed experts (s = σ(logit), S = Σ_j s_j), so
with g = ∂L/∂p:

    ∂L/∂s_j     = ρ / S · (g_j - Σ_i g_i s_i / S)
    ∂L/∂logit_e = ∂L/∂s_j · s_j (1 - s_j)   where e = ids[j],  0 for the E - k others

In PyTorch that is about a dozen kernels on [T, k] and a zero-filled [T, E] tensor scattered
into (12 launches eagerly; compiled, Inductor's div/sum kernel, the fill and the scatter: 3).
Here one program takes BLOCK_T tokens: it loads their k ids, routed logits and g, reduces S and
Σ g s in registers, and writes each [BLOCK_T, BLOCK_E] block of the dense gradient once, each
element the sum over the k slots of (ids == e) · ∂L/∂logit (ids are distinct within a row, so
that sum is the scatter). One launch, every output byte written once, no fill.

σ is ops/libdevice_math.py's (torch's CUDA expression on CUDA, NumPy's exp under the
interpreter); both divisions are IEEE ones (`tl.math.div_rn`), as torch's. S and Σ g s are tree
sums in fp32: the gradient agrees to fp32 rounding, not bit for bit, with the closed form above
in float64 (tests/ops/test_router.py) and with the reference's autograd
(tests/gpu/test_router_cuda.py).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.direct_call import direct_call
from titan_moe.ops.libdevice_math import sigmoid

BLOCK_T, MAX_BLOCK_E, WARPS = 16, 128, 4


@triton.jit
def route_weights_grad_kernel(ids_ptr, logit_ptr, g_ptr, out_ptr, T, route_scale,
                              E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                              LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    pair = rows[:, None] * K + slots[None, :]
    routed = row_ok[:, None] & (slots[None, :] < K)
    s = sigmoid(tl.load(logit_ptr + pair, mask=routed, other=0.0).to(tl.float32), LIBDEVICE)
    s = tl.where(routed, s, 0.0)
    g = tl.load(g_ptr + pair, mask=routed, other=0.0).to(tl.float32)
    total = tl.sum(s, axis=1)
    g_dot_s = tl.sum(g * s, axis=1)
    # IEEE divisions (Triton's `/` on fp32 is div.full.f32 on CUDA, up to 2 ulp): with them
    # g - Σ g s / S is exactly 0 where g is a power of two constant over a row, as in the PyTorch
    # closed form this kernel replaced and under the interpreter, instead of an ulp of noise
    # that Adam's ε-sized denominators amplify
    mean_g = tl.math.div_rn(g_dot_s, total)
    grad = route_scale * tl.math.div_rn(g - mean_g[:, None], total[:, None]) * s * (1.0 - s)
    ids = tl.load(ids_ptr + pair, mask=routed, other=-1)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        block = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for j in tl.static_range(K):
            # slot j's id and gradient of each row: a one-hot reduction of the [T, k] tiles
            at_j = slots[None, :] == j
            id_j = tl.sum(tl.where(at_j, ids, 0), axis=1)
            grad_j = tl.sum(tl.where(at_j, grad, 0.0), axis=1)
            block += tl.where(cols[None, :] == id_j[:, None], grad_j[:, None], 0.0)
        tl.store(out_ptr + rows[:, None] * E + cols[None, :], block,
                 mask=row_ok[:, None] & (cols[None, :] < E))


def _route_weights_grad(ids: Tensor, routed_logits: Tensor, grad_weights: Tensor,
                        route_scale: float, n_experts: int) -> Tensor:
    """ids [T, k] int64 (distinct within a row), routed_logits [T, k] (each row's logits at
    ids; fp32, bf16 or fp16), grad_weights [T, k] -> ∂L/∂logits [T, E] in routed_logits'
    dtype, computed in fp32."""
    ids, routed_logits = ids.contiguous(), routed_logits.contiguous()
    grad_weights = grad_weights.contiguous()
    n_tokens, top_k = ids.shape
    # Written in fp32, as the router's logits are; another dtype is a cast after (round to
    # nearest, which Triton's interpreter would not do in the kernel: it truncates).
    out = torch.empty(n_tokens, n_experts, dtype=torch.float32, device=ids.device)
    if n_tokens:
        wrap_triton(route_weights_grad_kernel)[(triton.cdiv(n_tokens, BLOCK_T),)](
            ids, routed_logits, grad_weights, out, n_tokens, route_scale, E=n_experts, K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_T,
            BLOCK_E=min(triton.next_power_of_2(n_experts), MAX_BLOCK_E),
            LIBDEVICE=ids.is_cuda, num_warps=WARPS,
        )  # fmt: skip
    return out if routed_logits.dtype == torch.float32 else out.to(routed_logits.dtype)


route_weights_grad_triton = triton_op("titan_moe::route_weights_grad", mutates_args=())(
    _route_weights_grad)
route_weights_grad_call = direct_call(route_weights_grad_triton, _route_weights_grad)
