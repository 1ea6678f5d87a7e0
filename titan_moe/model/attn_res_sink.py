"""Gradient sinks for the Block AttnRes sources (`attn_res_grad_sink`, for long context): a late
layer's backward holds one source gradient a site, not one for each of its n sources.

Every site reads every finished block, and a site's backward returns the gradients of its n
sources at once, which autograd then adds into each block's running gradient. At 1M tokens on
the proxy (d 2048, 9 sources) that is 36 GiB returned on top of the 36 GiB of running
gradients: the largest part of a late layer's backward (bench/RESULTS.md, 2026-12-06). With
sinks, a block's running gradient is a buffer its sink owns. Each site's backward adds its part
into that buffer in place (the Triton backward's accumulate mode) and returns None for the
block; the sink hands the sum to the block's producer. A None keeps the site's edge to the
block, so autograd still runs the sink after every site that read the block.

    block = sink_block(partial)                                 where model.py finishes a block
    out = sinked_mix(sources, query, gain, eps, out_dtype)      at each site

Eager only: a site's backward writes into a buffer that is none of its outputs, which a compiled
graph may not do. With sinks on, apply_compile leaves the sites eager (the op is the whole site).
A block's sum is rounded to its dtype once per site (the fp32 part added to the buffer), where
autograd rounded each returned part and then the sum.
"""

import torch
from torch import Tensor

from titan_moe.ops.attn_res import attn_res_mix_naive, uses_triton
from titan_moe.ops.attn_res.attn_res_triton import (
    attn_res_bwd_into,
    attn_res_fwd,
    fused_query,
    query_gain_grads,
)
from titan_moe.ops.attn_res.naive import validate_attn_res_inputs


class GradSink:
    """A block's running gradient: empty until the first site's backward writes it, then added
    to in place by every later one, and handed on (and dropped) by the block's _SinkBlock."""

    def __init__(self) -> None:
        self.grad: Tensor | None = None

    def buffer(self, like: Tensor) -> tuple[Tensor, bool]:
        """(the buffer, whether it already holds a sum to add to)."""
        if self.grad is None:
            self.grad = torch.empty_like(like, memory_format=torch.contiguous_format)
            return self.grad, False
        return self.grad, True


class _SinkBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sink: GradSink) -> Tensor:
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        total, ctx.sink.grad = ctx.sink.grad, None
        if grad is not None:  # a reader that is not a sinked site
            total = grad if total is None else total + grad
        return total, None


def sink_block(x: Tensor) -> Tensor:
    """x as a finished block whose sinked readers add their gradients into one buffer."""
    sink = GradSink()
    block = _SinkBlock.apply(x, sink)
    block.attn_res_sink = sink
    return block


class _SinkedMix(torch.autograd.Function):
    """A site's mix whose backward adds each sinked source's gradient into its sink and returns
    the others (the last partial sum, and any source not made by sink_block)."""

    @staticmethod
    def forward(ctx, query: Tensor, gain: Tensor, eps: float, out_dtype: torch.dtype,
                *sources: Tensor) -> Tensor:
        ctx.sinks = [getattr(v, "attn_res_sink", None) for v in sources]
        ctx.eps, ctx.out_dtype, ctx.triton = eps, out_dtype, uses_triton(list(sources))
        if ctx.triton:
            out, stats = attn_res_fwd(list(sources), query, gain, eps, out_dtype)
            ctx.save_for_backward(*sources, stats, query, gain)
            return out
        ctx.save_for_backward(*sources, query, gain)
        return attn_res_mix_naive(list(sources), query, gain, eps).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if ctx.triton:
            *sources, stats, query, gain = ctx.saved_tensors
            sources = [v.contiguous() for v in sources]
            grads, accumulate = [], []
            for v, sink in zip(sources, ctx.sinks, strict=True):
                grad, add = (torch.empty_like(v), False) if sink is None else sink.buffer(v)
                grads.append(grad)
                accumulate.append(add)
            du = attn_res_bwd_into(sources, stats, fused_query(query, gain), grad_out, grads,
                                   accumulate)
            d_query, d_gain = query_gain_grads(du, query, gain)
        else:
            *sources, query, gain = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [x.detach().requires_grad_() for x in (*sources, query, gain)]
                out = attn_res_mix_naive(leaves[:-2], leaves[-2], leaves[-1], ctx.eps)
                *grads, d_query, d_gain = torch.autograd.grad(out.to(ctx.out_dtype), leaves,
                                                              grad_out)
            for v, grad, sink in zip(sources, grads, ctx.sinks, strict=True):
                if sink is not None:
                    buffer, add = sink.buffer(v)
                    if add:
                        buffer.add_(grad)
                    else:
                        buffer.copy_(grad)
        source_grads = [None if sink is not None else grad
                        for grad, sink in zip(grads, ctx.sinks, strict=True)]
        return d_query, d_gain, None, None, *source_grads


def sinked_mix(sources: list[Tensor], query: Tensor, gain: Tensor, eps: float,
               out_dtype: torch.dtype) -> Tensor:
    """`titan_moe.ops.attn_res.attn_res_mix` (out_dtype given) with the sinked sources'
    gradients added into their sinks."""
    validate_attn_res_inputs(sources, query, gain, None)
    return _SinkedMix.apply(query, gain, eps, out_dtype, *sources)
