"""Our Triton ops called eagerly without torch.library's dispatch.

A `torch.library.triton_op` is what torch.compile needs: Inductor sees its kernels. Called
eagerly, though, it runs through custom_op's Python wrappers and the dispatcher twice (its
autograd kernel, then its CUDA kernel): 62 us a forward against 17 us for the same body in a
`torch.autograd.Function` (CPU host, launch stubbed, 2026-12-07). The d-512 MoE layer's eager
forward+backward makes ten such calls, host-bound on the H100: its custom ops' calls took 3.9 of
the profiled step's 8 ms, most of it outside their kernels' launches.

`direct_call(op, body, setup_context, backward)` gives the call to use: while anything traces,
the op; eagerly, `body` itself (the function the op was made from), in an autograd Function
built from the setup_context and backward registered on the op. Either way the same body runs
and the same gradient formula applies, so an op's tests of its triton_op against its reference
hold for both paths. Eagerly, `wrap_triton` launches the kernel directly, as it does inside a
triton_op (through its HOP it costs about 1 ms a call: torch's own comment).

"Eagerly" is: not under Dynamo and no dispatch mode active. AOTAutograd traces a registered
backward outside Dynamo, under its fake and functional modes, where torch 2.11's
`torch.compiler.is_compiling()` is False (2.13 holds it True for the whole compile); a body run
there would launch its kernel on fake tensors. So would any other tracer's (make_fx, export) or
a selective activation checkpoint's recompute: they all get the op.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch._library.triton import set_wrap_triton_enabled


def _plain_call(body: Callable) -> Callable:
    def run(*inputs):
        with set_wrap_triton_enabled(False):
            return body(*inputs)

    return run


def _autograd_call(body: Callable, setup_context: Callable, backward: Callable) -> Callable:
    def forward(ctx, *inputs):
        with set_wrap_triton_enabled(False):
            output = body(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def run_backward(ctx, *grads):
        with set_wrap_triton_enabled(False):
            return backward(ctx, *grads)

    # Named after the body, so autograd's node (and the profiler's row) is `<body>_directBackward`.
    function = type(f"{body.__name__}_direct", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(run_backward)})
    return function.apply


def direct_call(
    op: Callable, body: Callable, setup_context: Callable | None = None,
    backward: Callable | None = None,
) -> Callable[..., Any]:
    """op while anything traces (see the module's docstring); eagerly body, through an autograd
    Function made of setup_context and backward (as given to op.register_autograd) when they
    are given. Inputs are positional, as an autograd Function takes them."""
    if (setup_context is None) != (backward is None):
        raise ValueError("direct_call takes setup_context and backward together, or neither")
    eager = (_plain_call(body) if backward is None
             else _autograd_call(body, setup_context, backward))

    def call(*inputs):
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return op(*inputs)
        return eager(*inputs)

    call.__name__ = call.__qualname__ = f"{body.__name__}_call"
    return call
