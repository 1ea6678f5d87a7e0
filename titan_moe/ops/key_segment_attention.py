"""Causal document attention by key segments, merged by log-sum-exp, with each key segment's
keys and values projected inside the loop from per-position inputs (MLA: from its latents), so
neither pass holds more than one key segment's keys and values (ring / flash attention's merge).

Queries q [B, T, H, D] are the last T of S key positions. The keys split into the queries' own
positions (the diagonal segment, causal) and, before them, segments of `key_segment` positions
counted back from the queries (the first may be shorter), each wholly earlier than every query:

    forward, per key segment j:  k_j, v_j = project(inputs_j)
        (o_j, lse_j) = softmax attention of q over k_j, v_j under the causal/document mask
        lse' = logaddexp(lse, lse_j);  o <- o e^(lse - lse') + o_j e^(lse_j - lse')
    backward (o, lse the merged ones; δ = rowsum(dO ∘ O)), per key segment j, recomputed:
        k_j, v_j = project(inputs_j);  P_j = exp(q k_jᵀ scale - lse)   (0 where masked)
        dV_j = P_jᵀ dO;  dS_j = P_j ∘ (dO v_jᵀ - δ);  dQ += dS_j k_j scale;  dK_j = dS_jᵀ q scale
        then the projection's own backward: dK_j, dV_j -> its inputs' and weights' gradients.

A query row that no key of segment j may see (all of j in earlier documents) has lse_j = -inf:
its o_j is 0 and its merge weight e^(-inf) = 0, computed against a finite stand-in for the
merged lse while that is still -inf, so no -inf - -inf (NaN) arises. Every row sees at least
its own position, so the final lse is finite.

The running output and lse are in at least float32 (float64 stays). Each segment pair's
attention and its backward are ops/segment_pair_attention.py's: Flash Attention's varlen
kernels on CUDA in half precision, plain PyTorch (the pair's scores materialised) elsewhere.

The projection is a class (its static methods trace under torch.compile(fullgraph=True), as
the autograd.Function's forward and backward do):

    project(inputs, weights, options) -> (k [B, s, H, D], v [B, s, H, Dv])
    backward(dk, dv, inputs, weights, options) -> (inputs' gradients, weights' gradients)

`inputs` are per-position tensors [B, S, ...] (sliced per key segment), `weights` whole tensors
(their gradients summed over the segments), `options` a tuple of Python constants.
"""

from typing import Any, Protocol

import torch

from titan_moe.ops.segment_pair_attention import finite, pair_backward, pair_forward


class KeyProjection(Protocol):
    @staticmethod
    def project(inputs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...],
                options: tuple) -> tuple[torch.Tensor, torch.Tensor]: ...

    @staticmethod
    def backward(dk: torch.Tensor, dv: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], options: tuple
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]: ...


class GivenKeys:
    """The identity projection: inputs (k, v) are the keys and values themselves."""

    @staticmethod
    def project(inputs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...],
                options: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs[0], inputs[1]

    @staticmethod
    def backward(dk: torch.Tensor, dv: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], options: tuple
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return (dk, dv), ()


def key_segment_attention(
    q: torch.Tensor,
    q_doc: torch.Tensor | None,
    kv_doc: torch.Tensor | None,
    inputs: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, ...],
    projection: type[KeyProjection],
    options: tuple,
    key_segment: int,
    scale: float,
) -> torch.Tensor:
    """softmax(q kᵀ scale + causal/document mask) v over keys projected per key segment from
    `inputs` (see the module docstring): the queries' own T positions, and before them segments
    of at most key_segment positions; q [B, T, H, D] are the last T positions, q_doc [B, T] /
    kv_doc [B, S] their documents (None: one document). Returns [B, T, H, Dv] in q's dtype."""
    return _KeySegmentAttention.apply(q, q_doc, kv_doc, projection, options, key_segment,
                                      scale, len(inputs), *inputs, *weights)


def key_segments(keys: int, queries: int, key_segment: int) -> list[tuple[int, int]]:
    """[start, end) of each key segment: segments of key_segment positions counted back from
    the queries' first position, then the queries' own positions (the diagonal, last)."""
    first_query = keys - queries
    starts = range(first_query - key_segment, -key_segment, -key_segment)
    earlier = [(max(start, 0), start + key_segment) for start in reversed(starts)]
    return [*earlier, (first_query, keys)]


def _slices(tensors: tuple[torch.Tensor, ...], start: int, end: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[:, start:end] for t in tensors)


def _doc_slice(kv_doc: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if kv_doc is None else kv_doc[:, start:end]


class _KeySegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, q_doc: torch.Tensor | None,
                kv_doc: torch.Tensor | None, projection: type[KeyProjection], options: tuple,
                key_segment: int, scale: float, n_inputs: int, *tensors: torch.Tensor
                ) -> torch.Tensor:
        inputs, weights = tensors[:n_inputs], tensors[n_inputs:]
        queries, keys = q.shape[1], inputs[0].shape[1]
        out = lse = None
        for start, end in key_segments(keys, queries, key_segment):
            k, v = projection.project(_slices(inputs, start, end), weights, options)
            o_j, lse_j = pair_forward(q, k, v, q_doc, _doc_slice(kv_doc, start, end), start,
                                      keys, scale)
            if out is None:
                out, lse = o_j, lse_j
                continue
            merged = torch.logaddexp(lse, lse_j)
            # A finite stand-in while no key was seen yet: both weights are then e^-inf = 0.
            stand_in = finite(merged)[..., None]
            out = out * torch.exp(lse[..., None] - stand_in) + o_j * torch.exp(
                lse_j[..., None] - stand_in)
            lse = merged
        o = out.to(q.dtype)
        ctx.save_for_backward(q, q_doc, kv_doc, o, lse, *tensors)
        ctx.projection, ctx.options, ctx.key_segment = projection, options, key_segment
        ctx.scale, ctx.n_inputs = scale, n_inputs
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, q_doc, kv_doc, o, lse, *tensors = ctx.saved_tensors
        inputs, weights = tuple(tensors[: ctx.n_inputs]), tuple(tensors[ctx.n_inputs:])
        queries, keys = q.shape[1], inputs[0].shape[1]
        dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        d_inputs: list[tuple[torch.Tensor, ...]] = []
        d_weights = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
                     for w in weights]
        for start, end in key_segments(keys, queries, ctx.key_segment):
            segment_inputs = _slices(inputs, start, end)
            k, v = ctx.projection.project(segment_inputs, weights, ctx.options)
            dq_j, dk, dv = pair_backward(q, k, v, o, lse, do, q_doc,
                                         _doc_slice(kv_doc, start, end), start, keys, ctx.scale)
            dq = dq + dq_j
            d_in, d_w = ctx.projection.backward(dk, dv, segment_inputs, weights, ctx.options)
            d_inputs.append(d_in)
            d_weights = [total + grad for total, grad in zip(d_weights, d_w, strict=True)]
        grads_in = [torch.cat(parts, 1) for parts in zip(*d_inputs, strict=True)]
        grads_w = [grad.to(w.dtype) for grad, w in zip(d_weights, weights, strict=True)]
        return (dq.to(q.dtype), None, None, None, None, None, None, None, *grads_in, *grads_w)
