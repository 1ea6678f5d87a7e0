"""fp32 math for Triton kernels that matches torch's CUDA kernels on the GPU and still runs under
Triton's CPU interpreter (the op tests), which has no libdevice.

`LIBDEVICE` (constexpr, the launcher passes `tensor.is_cuda`) picks the path:
    sigmoid   1 / (1 + exp(-x)) with libdevice's expf and an IEEE division, the expression and
              functions torch.sigmoid's CUDA kernel uses; the interpreter's exp is NumPy's,
              whose last bit can differ from torch's CPU exp
    tanh      libdevice's tanhf; the interpreter's comes from exp, (1 - e^-2|x|) / (1 + e^-2|x|)
              with the sign of x, exact to about 1e-7 absolute
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def sigmoid(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(1.0, 1.0 + e)


@triton.jit
def tanh(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.tanh(x)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)
