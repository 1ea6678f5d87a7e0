"""What a layer's backward saves, counted on the meta device, for the memory model (memory.py)
to add up.

A layer runs on meta with saved-tensor hooks (each storage once, parameters excluded) under what
the compiled CUDA step runs: the Triton ops themselves (AttnRes, short conv, router, MoE
dispatch and combine: their fake kernels run on meta and their autograd saves what CUDA saves),
stand-ins for flash attention (q, k, v, out, fp32 logsumexp), the KDA op (its inputs) and
torch._grouped_mm (its operands), and SiTU-GLU and RMSNorm as Inductor fuses them (inputs only).
Approximate: the other eager elementwise saves inside the mixers, and with router_gemm "fp32"
the router's fp32 input copy (Inductor may recompute them: the plan is high there; the default
split_bf16 GEMM saves the bf16 input itself), the backward's transient as twice
the largest saved tensor or the KDA op's, MLA's key-segment attention's or an AttnRes site's
workspace (counted on meta, op_workspace.py, Flash's fp32 dq accumulator added by hand; other
ops' workspaces are not).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple
from unittest import mock

import torch

from titan_moe.model import attn_res as attn_res_module
from titan_moe.model import kda as kda_module
from titan_moe.model import mla as mla_module
from titan_moe.model import moe as moe_module
from titan_moe.model import router as router_module
from titan_moe.model import situ_glu as situ_glu_module
from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.attn_res_sink import sink_block
from titan_moe.model.model import DecoderLayer
from titan_moe.model.norm import RMSNorm
from titan_moe.ops.attn_res import attn_res_mix_triton
from titan_moe.ops.moe_dispatch import moe_combine_triton, moe_dispatch_triton
from titan_moe.ops.router import qb_route_triton
from titan_moe.ops.short_conv.short_conv_triton import short_conv_triton
from titan_moe.parallel.fp32_modules import FP32_MODULES
from titan_moe.parallel.pipeline import boundary_tensors
from titan_moe.plan.op_workspace import (
    attn_res_backward_workspace,
    kda_backward_workspace,
    kda_kept_buffers,
    mla_key_segment_backward_workspace,
)


class Saved(NamedTuple):
    total: int  # bytes of the distinct storages saved for backward
    largest: int  # the largest of them
    workspace: int = 0  # the largest backward workspace of an op run (op_workspace.py)

    @property
    def transient(self) -> int:
        """What the layer's backward holds besides its saves: the gradients of its largest op's
        output and input, alive together while that op runs, or an op's own backward workspace
        (the KDA op's), whichever is larger."""
        return max(2 * self.largest, self.workspace)

    @property
    def recompute(self) -> int:
        """What a checkpointed layer's backward holds: its recompute's saves and its transient."""
        return self.total + self.transient


def saved_bytes(run, exclude: list[torch.Tensor]) -> Saved:
    """The distinct storages autograd saves while `run()` executes, minus `exclude`'s."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    # Holding each storage keeps its address from being reused by a later one within the run
    # (a branch whose graph is dropped frees its saved tensors), which would count two as one.
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage
        return t

    first = len(_op_workspaces)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    sizes = [s.nbytes() for s in seen.values()]
    workspace = max(_op_workspaces[first:], default=0)
    del _op_workspaces[first:]
    return Saved(sum(sizes), max(sizes, default=0), workspace)


class _SavesForBackward(torch.autograd.Function):
    """Output of a given shape; saves the given tensors (what a fused kernel keeps)."""

    @staticmethod
    def forward(ctx, out_like: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        return torch.empty_like(out_like)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a memory-plan stand-in; it never runs backward")


class _SavesOutputForBackward(_SavesForBackward):
    """Output of a given shape; saves it and the given tensors."""

    @staticmethod
    def forward(ctx, out_like: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(out_like)
        ctx.save_for_backward(out, *saved)
        return out


def _flash_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    b, h, t, _ = q.shape
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(b, h, t, dtype=torch.float32)
    return _SavesForBackward.apply(out, q, k, v, out, lse)


# The backward workspaces of the ops the stand-ins ran, for saved_bytes to take the largest.
_op_workspaces: list[int] = []


def _kda_triton_op(q, k, v, g_raw, A_log, dt_bias, beta, g_min=-5.0, output_final_state=False,
                   **kwargs):
    batch, seq_len, heads, d_k = q.shape
    _op_workspaces.append(kda_backward_workspace(batch, seq_len, heads, d_k, v.shape[-1],
                                                 A_log is not None))
    kept = kda_kept_buffers(batch, seq_len, heads, d_k, v.shape[-1], q.device)
    # The state KDA segments pass on (model/kda.py), fp32 as the op returns it.
    final = (q.new_empty(batch, heads, d_k, v.shape[-1], dtype=torch.float32)
             if output_final_state else None)
    return _SavesForBackward.apply(v, q, k, v, g_raw, beta, A_log, dt_bias, *kept), final


def _key_segment_attention(q, q_doc, kv_doc, inputs, weights, projection, options,
                           key_segment, scale):
    """MLA's attention by key segments: it saves q, its output and the fp32 lse (the latents
    are the segment's inputs, the weights parameters); its backward's workspace counted."""
    c_kv, k_rope = inputs
    batch, queries, heads, qk = q.shape
    v_dim = weights[1].shape[0] // heads - options[1]
    _op_workspaces.append(mla_key_segment_backward_workspace(
        batch, queries, c_kv.shape[1], key_segment, heads, qk, v_dim, c_kv.shape[-1],
        k_rope.shape[-1]))
    out = q.new_empty(batch, queries, heads, v_dim)
    lse = q.new_empty(batch, queries, heads, dtype=torch.float32)
    return _SavesForBackward.apply(out, q, out, lse)


def _sinked_mix(sources, query, gain, eps, out_dtype):
    """A site with gradient sinks (model/attn_res_sink.py): its backward returns the gradients
    of its sources without a sink only (the last partial sum); the blocks' parts are added into
    their sinks, which are the blocks' running gradients, counted with the loss phase's."""
    dim = sources[0].shape[-1]
    returned = tuple(v.dtype for v in sources if getattr(v, "attn_res_sink", None) is None)
    _op_workspaces.append(attn_res_backward_workspace(
        sources[0].numel() // dim, dim, returned, out_dtype))
    return attn_res_mix_triton(sources, query, gain, eps, out_dtype)


def _attn_res_mix(sources, query, gain, eps, out_dtype=None):
    """The AttnRes op itself; its backward's workspace (the n source gradients it returns
    together) counted."""
    dim = sources[0].shape[-1]
    out_dtype = out_dtype or torch.float32
    _op_workspaces.append(attn_res_backward_workspace(
        sources[0].numel() // dim, dim, tuple(v.dtype for v in sources), out_dtype))
    return attn_res_mix_triton(sources, query, gain, eps, out_dtype)


def _grouped_gemm(x, w, offs, zero_padding_rows=True):
    return torch._grouped_mm(x, w.to(x.dtype), offs=offs)


def _short_conv(x, weight, doc_ids=None, head_dim=None):
    docs = None if doc_ids is None else doc_ids.to(torch.int32)
    return short_conv_triton(x, weight, docs, head_dim or 0)


def _qb_route(logits, bias, top_k, route_scale=1.0, n_bins=1000, valid=None,
              with_histogram=True):
    return qb_route_triton(logits, bias, valid, top_k, route_scale, n_bins, with_histogram)


# Inductor fuses an elementwise chain into one kernel and its partitioner saves the chain's
# inputs, recomputing the fp32 intermediates that eager autograd would save.
def _situ_glu_packed(ab, beta1=4.0, beta2=25.0):
    return _SavesForBackward.apply(ab[..., : ab.shape[-1] // 2], ab)


def _rms_norm(self, x):
    rstd = x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
    if self.saves_output:  # model/norm.py: its output instead of its input
        return _SavesOutputForBackward.apply(x, rstd)
    return _SavesForBackward.apply(x, x, rstd)


@contextlib.contextmanager
def _cuda_kernel_stand_ins() -> Iterator[None]:
    """What the compiled CUDA step saves: Flash attention and the KDA op by stand-ins; the
    Triton ops (AttnRes, short conv, router, MoE dispatch and combine) themselves, whose fake
    kernels run on meta and whose autograd saves what CUDA saves; SiTU-GLU and RMSNorm as
    Inductor fuses them."""
    patches = [
        mock.patch.object(mla_module.F, "scaled_dot_product_attention", _flash_attention),
        mock.patch.object(mla_module, "key_segment_attention", _key_segment_attention),
        # The layer binds its recurrence and conv at class level, so the stand-ins go there.
        mock.patch.object(kda_module.KimiDeltaAttention, "sequence_recurrence",
                          staticmethod(_kda_triton_op)),
        mock.patch.object(kda_module.KimiDeltaAttention, "sequence_conv_act",
                          staticmethod(_short_conv)),
        mock.patch.object(moe_module, "grouped_mm", _grouped_gemm),
        mock.patch.object(moe_module, "moe_dispatch", moe_dispatch_triton),
        mock.patch.object(moe_module, "moe_combine", moe_combine_triton),
        mock.patch.object(moe_module, "situ_glu_packed", _situ_glu_packed),
        mock.patch.object(situ_glu_module, "situ_glu_packed", _situ_glu_packed),
        mock.patch.object(router_module, "qb_route", _qb_route),
        mock.patch.object(attn_res_module, "ops_attn_res_mix", _attn_res_mix),
        mock.patch.object(attn_res_module, "sinked_mix", _sinked_mix),
        mock.patch.object(RMSNorm, "forward", _rms_norm),
        # torch.autocast has no meta device; the model only uses it to switch AMP off.
        mock.patch.object(torch, "autocast", lambda *a, **k: contextlib.nullcontext()),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _bf16_with_fp32_islands(module: torch.nn.Module) -> torch.nn.Module:
    module.to(torch.bfloat16)
    for sub in module.modules():
        if isinstance(sub, FP32_MODULES):
            sub.float()
    return module


def _sources(args: TitanMoEArgs, n: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    return [torch.empty(batch, seq_len, args.dim, dtype=torch.bfloat16, device="meta",
                        requires_grad=True) for _ in range(n)]


def layer_activation_bytes(args: TitanMoEArgs, layer_id: int, batch: int, seq_len: int) -> Saved:
    """What one decoder layer saves for backward (its inputs excluded), bf16 with fp32 islands:
    under full AC, what its recompute holds in backward. Of a sublayer run by checkpointed
    pieces (a MoE layer in token chunks, moe_token_chunk; a KDA or MLA mixer in segments and a
    dense FFN in chunks, seq_segment) the hook sees the pieces' inputs, which their checkpoints
    save (views of the sublayer's input and of MLA's latents, and a KDA segment's carried state
    and conv taps); the largest piece's recompute, alive in the layer's backward one piece at a
    time, is added (without AC that is counted per layer: high by a piece's saves for every
    other such layer)."""
    with torch.device("meta"):
        layer = _bf16_with_fp32_islands(DecoderLayer(layer_id, args))
    # Entering layer i: the embedding, every finished block and the partial sum.
    sources = _sources(args, boundary_tensors(args.attn_res_block_size, layer_id), batch, seq_len)
    if args.attn_res_grad_sink:  # the finished blocks came through sink_block
        sources = [sink_block(v) for v in sources[:-1]] + sources[-1:]
    params = list(layer.parameters())
    with _cuda_kernel_stand_ins():
        saved = saved_bytes(lambda: layer(sources[:-1], sources[-1], None), params + sources)
    tokens, segment = batch * seq_len, args.seq_segment
    chunk = args.moe_token_chunk if args.is_moe(layer_id) else segment
    pieces = []
    if 0 < chunk < tokens:
        pieces.append(ffn_chunk_bytes(args, layer_id, chunk))
    if 0 < segment < seq_len:
        pieces.append(mla_segment_bytes(args, layer_id, batch, segment, seq_len)
                      if args.is_mla(layer_id) else
                      mixer_segment_bytes(args, layer_id, batch, segment))
    if not pieces:
        return saved
    one = max(pieces, key=lambda piece: piece.recompute)
    return Saved(saved.total + one.total, max(saved.largest, one.largest),
                 max(saved.workspace, one.workspace))


def _whole(args: TitanMoEArgs, layer_id: int) -> DecoderLayer:
    """The decoder layer with every sublayer run whole (no chunks, no segments)."""
    with torch.device("meta"):
        return _bf16_with_fp32_islands(
            DecoderLayer(layer_id, replace(args, moe_token_chunk=0, seq_segment=0)))


def ffn_chunk_bytes(args: TitanMoEArgs, layer_id: int, chunk: int) -> Saved:
    """What one token chunk's recompute saves (its input excluded): the layer's FFN (MoE or
    dense), unchunked, over `chunk` tokens, a MoE's own padded dispatch buffer included."""
    ffn = _whole(args, layer_id).ffn
    x = _sources(args, 1, 1, chunk)
    with _cuda_kernel_stand_ins():
        return saved_bytes(lambda: ffn(x[0]), list(ffn.parameters()) + x)


def mixer_segment_bytes(args: TitanMoEArgs, layer_id: int, batch: int, segment: int) -> Saved:
    """What one KDA segment's recompute saves (its input excluded) and its op's backward
    workspace: the mixer, unsegmented, over `segment` positions of each row."""
    mixer = _whole(args, layer_id).mixer
    x = _sources(args, 1, batch, segment)
    with _cuda_kernel_stand_ins():
        return saved_bytes(lambda: mixer(x[0]), list(mixer.parameters()) + x)


def mla_segment_bytes(args: TitanMoEArgs, layer_id: int, batch: int, segment: int,
                      seq_len: int) -> Saved:
    """What the largest MLA query segment's recompute saves (its inputs excluded) and its
    attention's backward workspace: the last one, `segment` queries of each row against the
    keys of all seq_len positions by key segments of `segment`, each up-projected from its
    latents [c_kv | k_rope] (an input: computed once for the whole sequence). Its saves do not
    grow with seq_len; its workspace grows by the latents' gradient only."""
    mixer = _whole(args, layer_id).mixer
    x = _sources(args, 1, batch, segment)[0]
    latent = torch.empty(batch, seq_len, mixer.kv_lora + mixer.rope, device="meta",
                         dtype=mixer.w_kva.weight.dtype, requires_grad=True)
    c_kv, k_rope = latent.split([mixer.kv_lora, mixer.rope], dim=-1)
    mixer.seq_segment = segment
    with _cuda_kernel_stand_ins():
        return saved_bytes(lambda: mixer._query_segment(x, None, c_kv, k_rope, None),
                           list(mixer.parameters()) + [x, latent])


def head_activation_bytes(args: TitanMoEArgs, batch: int, seq_len: int) -> Saved:
    """What the final AttnRes site and norm save (their sources excluded)."""
    with torch.device("meta"):
        site = AttnResSite(args.dim, args.attn_res_eps)
        norm = _bf16_with_fp32_islands(RMSNorm(args.dim, eps=args.norm_eps))
    sources = _sources(args, boundary_tensors(args.attn_res_block_size, args.n_layers), batch,
                       seq_len)
    params = list(site.parameters()) + list(norm.parameters())
    with _cuda_kernel_stand_ins():
        return saved_bytes(lambda: norm(site(sources)), params + sources)
