"""Per-GPU memory plan for FSDP2 × expert-parallel × context-parallel layouts, and the fewest
GPUs a model fits on; also the long-context bench's step (`bench_estimate`).

    python -m titan_moe.plan --config configs/stages/1m.toml
    python -m titan_moe.plan --config configs/full.toml --gpus 1024 --gpu-mem 141
    python -m titan_moe.plan --config configs/proxy.toml --validate      (one CUDA GPU)

On N GPUs with EP degree ep or CP degree cp (CP runs without EP, as the trainer requires), P
parameters, L the unsharded bytes of the largest layer (dense part + E/ep experts, bf16), a GPU
holding b rows of t = T / cp positions, s = 2 b t d (one bf16 residual stream), V the vocabulary,
S the AttnRes block size, n layers, B = ceil(n / S) blocks:

    parameters   4 P / N            fp32 master weights, every parameter sharded over N ranks
    gradients    4 P / N            fp32 sharded gradients (present by the end of backward)
    optimizer    8 P / N            AdamW exp_avg and exp_avg_sq, fp32 (fused: no temporaries)
    working      10 L + 2 V d       backward of one layer: its bf16 params, the next layer's
                                    (prefetch), bf16 grads and their fp32 copy for the
                                    reduce-scatter; the LM head, kept unsharded fwd -> bwd
    activations  saved + max(loss phase, layer backward), where
      saved      layers not checkpointed: what each saves; every layer's incoming partial sum
                 (n s: the checkpoint inputs, the blocks among them); the tail: the last partial
                 sum, the final site's and norm's saves, the loss's hidden input (2 s + ...), and
                 chunked, its fp32 log-sum-exp and int64 labels (12 b t)
      offload    (training.activation_offload: save_on_cpu) the checkpoints' saves go to the host,
                 n (s + 4 b t) with the doc ids, and the tail but the last partial sum, with the
                 head weight; the last block list (B s), held by reference, stays on the GPU,
                 and the last partial sum until the loss phase ends (+ s to that phase: the
                 final site keeps its saves on the GPU, FinalAttnResSite)
      loss phase the larger of the loss's backward, chunked (training.loss_chunk = c): 12 c V
                 (one chunk's logits and gradient) + 4 V d (fp32 head-weight gradient) + s, full
                 logits: 12 b t V; and the final site's: (B + 1) s (its sources' gradients)
                 + 4 b t d (its fp32 output's gradient) + 12 (B + 1) b t (its stats' gradient)
      layer bwd  a layer's transient is the larger of 2 × its largest saved tensor (an op's
                 output and input gradients) and an op's backward workspace (op_workspace.py):
                 the KDA op's (dO, the gradients, and its fp32 buffers, 5.1 kB a token and
                 head at K = V = 128 over one 64K segment), MLA's attention by key segments'
                 (below) or an AttnRes site's (its n sources' gradients, returned together, and
                 its output's fp32 gradient: (n + 2) s). Without AC, the largest transient;
                 with AC, the largest over layers of its recompute's saves + its transient,
                 + (B + 1) s (gradients of the residual sources) + the offloaded inputs brought
                 back (s + 4 b t); a sublayer run by checkpointed pieces saves their inputs
                 and holds one piece's recompute at a time, so the layer adds its largest
                 piece's: a MoE chunk (titan_moe.moe_token_chunk = c), the MoE unchunked over
                 c tokens; a KDA segment (titan_moe.seq_segment = g), the mixer unsegmented
                 over g positions of each row (its op's workspace over g); an MLA query
                 segment, the last: g queries against all t keys by key segments of g, each
                 up-projected from the latents (saves q, out, lse; its backward's workspace:
                 one key segment's keys, values and Flash buffers, and the latents' gradient
                 over t, op_workspace.py); a dense-FFN chunk, the FFN over g tokens
    host         the offloaded bytes; fits: peak <= 90% of the GPU and host <= 90% of host RAM
    peak         parameters + optimizer + working + max(activations, gradients)
    bench        2 P weights + max(activations, 2 P gradients): bf16, one GPU, no optimizer

Gradients grow while the saved activations drain during backward, both about linearly, so the
larger of the two ends is the peak. Per-layer saved activations are counted by running the
layer on the meta device with saved-tensor hooks (each storage once, parameters excluded) under
what the compiled CUDA step runs: the Triton ops themselves (AttnRes, short conv, router, MoE
dispatch and combine: their fake kernels run on meta and their autograd saves what CUDA saves),
stand-ins for flash attention (q, k, v, out, fp32 logsumexp), the KDA op (its inputs) and
torch._grouped_mm (its operands), and SiTU-GLU and RMSNorm as Inductor fuses them (inputs only).
Approximate: the other eager elementwise saves inside the mixers, and with router_gemm "fp32"
the router's fp32 input copy (Inductor may recompute them: the plan is high there; the default
split_bf16 GEMM saves the bf16 input itself), the backward's transient as twice
the largest saved tensor or the KDA op's, MLA's key-segment attention's or an AttnRes site's
workspace (counted on meta, op_workspace.py, Flash's fp32 dq accumulator added by hand; other
ops' workspaces are not), MLA's gathered prefix under CP (not counted), allocator fragmentation
(in the 10% headroom).
"""

import contextlib
import math
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple
from unittest import mock

import torch

from titan_moe.model import attn_res as attn_res_module
from titan_moe.model import kda as kda_module
from titan_moe.model import mla as mla_module
from titan_moe.model import moe as moe_module
from titan_moe.model import router as router_module
from titan_moe.model import situ_glu as situ_glu_module
from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.attn_res_sink import sink_block
from titan_moe.model.model import DecoderLayer, TitanMoE
from titan_moe.model.norm import RMSNorm
from titan_moe.ops.attn_res import attn_res_mix_triton
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE
from titan_moe.ops.moe_dispatch import moe_combine_triton, moe_dispatch_triton
from titan_moe.ops.router import qb_route_triton
from titan_moe.ops.short_conv.short_conv_triton import short_conv_triton
from titan_moe.parallel.fp32_modules import FP32_MODULES
from titan_moe.parallel.parallelize import OP_SAC_SAVE_LIST, apply_fsdp
from titan_moe.parallel.pipeline import boundary_tensors
from titan_moe.plan.op_workspace import (
    attn_res_backward_workspace,
    kda_backward_workspace,
    kda_kept_buffers,
    mla_key_segment_backward_workspace,
)

GB = 1e9
GIB = 2**30
ACT_BYTES = 2  # bf16 activations under FSDP2's bf16 param policy
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
BENCH_BYTES = 2  # bench/long_context.py: bf16 weights and gradients, no master copy, no optimizer
DOC_ID_BYTES, LABEL_BYTES, LSE_BYTES = 4, 8, 4  # int32 doc ids, int64 labels, fp32 log-sum-exp
HEADROOM = 0.9  # of the GPU's memory: allocator fragmentation, NCCL buffers, CUDA context
HOST_MEM_GB = 128 * GIB / GB  # host RAM of the one-H200 machine the long-context bench runs on
HOST_HEADROOM = 0.9  # of the host's memory: the process, the data loader, the page cache
AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class PlanConfig:
    args: TitanMoEArgs
    seq_len: int
    local_batch: int
    ac_mode: str
    selective_ac_option: str
    loss_chunk: int = 0  # training.loss_chunk: positions a chunk of the LM-head loss; 0: full
    offload: bool = False  # training.activation_offload: saved tensors to pinned host memory
    cp: int = 1  # parallelism.context_parallel_degree: a GPU holds seq_len / cp positions


@dataclass(frozen=True)
class ParamCounts:
    total: int
    experts: int
    embedding: int
    output: int
    largest_layer_dense: int
    largest_layer_experts: int
    layer_dense: tuple[int, ...] = ()  # per decoder layer (pipeline stages are cut from these)
    layer_experts: tuple[int, ...] = ()

    @property
    def rest(self) -> int:
        """Parameters outside the layers, embedding and head: vision tower, final site, norm."""
        return (self.total - sum(self.layer_dense) - sum(self.layer_experts) - self.embedding
                - self.output)


class Activations(NamedTuple):
    device: float  # activation bytes on the GPU at the step's peak
    host: float  # bytes offloaded to pinned host memory at the end of forward


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


@dataclass(frozen=True)
class Estimate:
    gpus: int
    ep: int
    parameters: float
    gradients: float
    optimizer: float
    working: float
    activations: float
    peak: float
    cp: int = 1
    host: float = 0.0  # pinned host bytes per GPU (offloaded activations)

    def fits(self, gpu_mem_gb: float, host_mem_gb: float = HOST_MEM_GB,
             headroom: float = HEADROOM) -> bool:
        return (self.peak <= headroom * gpu_mem_gb * GB
                and self.host <= HOST_HEADROOM * host_mem_gb * GB)


def _field(table: dict, section: str, key: str, kind: type, default, valid, allowed: str):
    value = table.get(section, {}).get(key, default)
    # bool is an int subclass: a flag given as a count (or a count as a flag) is a mistake.
    if type(value) is not kind or not valid(value):
        raise ConfigError(f"{section}.{key} = {value!r}: allowed {allowed}")
    return value


def load_plan_config(path: str) -> PlanConfig:
    """The model, sequence length, batch, AC policy, loss chunk, activation offload and context
    parallelism of a TOML (nothing else is needed)."""
    with open(path, "rb") as f:
        toml = tomllib.load(f)
    model = toml.get("model", {})
    args = model_args(model.get("flavor", "debug"), **toml.get("titan_moe", {}))
    training = toml.get("training", {})
    ac = toml.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    if mode not in AC_MODES or (mode == "selective" and not option.isdigit()):
        raise ConfigError(
            f"activation_checkpoint mode {mode!r} / selective_ac_option {option!r}: the plan "
            "models none, full and layer-selective (a digit) checkpointing"
        )
    seq_len = training.get("seq_len", 2048)
    loss_chunk = _field(toml, "training", "loss_chunk", int, 0, lambda n: n >= 0,
                        "an integer >= 0 (0: full logits)")
    offload = _field(toml, "training", "activation_offload", bool, False,
                     lambda on: not on or mode == "full",
                     "true (with activation_checkpoint.mode = 'full') or false")
    cp = _field(toml, "parallelism", "context_parallel_degree", int, 1,
                lambda n: n >= 1 and not seq_len % (n * KDA_CHUNK_SIZE)
                and (n == 1 or not args.seq_segment),
                f"an integer >= 1 with seq_len a multiple of it x {KDA_CHUNK_SIZE}, 1 with "
                "titan_moe.seq_segment > 0")
    return PlanConfig(args, seq_len, training.get("local_batch_size", 8), mode, option,
                      loss_chunk, offload, cp)


def parameter_counts(args: TitanMoEArgs) -> ParamCounts:
    with torch.device("meta"):
        model = TitanMoE(args)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    dense_per_layer, experts_per_layer = [], []
    for layer in model.layers.values():
        e = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("ffn.experts."))
        experts_per_layer.append(e)
        dense_per_layer.append(sum(p.numel() for p in layer.parameters()) - e)
    return ParamCounts(
        total=sum(p.numel() for p in model.parameters()),
        experts=experts,
        embedding=model.tok_embeddings.weight.numel(),
        output=model.output.weight.numel(),
        largest_layer_dense=max(dense_per_layer),
        largest_layer_experts=max(experts_per_layer),
        layer_dense=tuple(dense_per_layer),
        layer_experts=tuple(experts_per_layer),
    )


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


def _checkpointed(cfg: PlanConfig, layer_id: int) -> bool:
    if cfg.ac_mode == "full":
        return True
    if cfg.ac_mode == "selective":
        return layer_id % int(cfg.selective_ac_option) == 0
    return False


def loss_phase_bytes(cfg: PlanConfig, b: int, t: int) -> float:
    """What the loss phase of backward holds at its peak above what is saved: the larger of the
    loss's backward and the final AttnRes site's. The loss, chunked: one chunk's logits (bf16
    product, fp32 copy and its exp) and their gradient, the fp32 head-weight gradient and the
    hidden states' gradient; full logits: the fp32 log-softmax, its and the logits' gradient.
    The site: its output's gradient (in the sources' dtype: its op writes that dtype and reads
    the gradient as it comes, where autograd used to hand it an fp32 copy), one gradient for
    each of its n sources (the finished blocks and the last partial sum; they live on into the
    layers' backward) and the zero gradient autograd makes for its op's fp32 stats (12 n bytes
    a position). The norm's backward between them (its fp32 input brought back, its
    output's and input's gradients) holds less than the site's for every flavor."""
    args = cfg.args
    stream = b * t * args.dim * ACT_BYTES
    if cfg.loss_chunk:
        chunk = min(cfg.loss_chunk, b * t)
        loss = 12 * chunk * args.vocab_size + 4 * args.vocab_size * args.dim + stream
    else:
        loss = 12 * b * t * args.vocab_size
    sources = boundary_tensors(args.attn_res_block_size, args.n_layers)
    site = (sources + 1) * stream + b * t * 12 * sources
    return max(loss, site)


def activation_bytes(cfg: PlanConfig, layers: range | None = None, batch: int | None = None,
                     loss: bool = True, held: float = 1) -> Activations:
    """Activation bytes at the step's peak on a GPU (and on its host, offloaded): of the whole
    model at the local batch, or of `layers` (a pipeline stage, with the loss if it is the
    last) at `batch` rows (a micro-batch), the saved part for `held` micro-batches at once (the
    loss and the recompute are one micro-batch's at a time). A GPU holds seq_len / cp
    positions of each row."""
    args, t = cfg.args, cfg.seq_len // cfg.cp
    b = cfg.local_batch if batch is None else batch
    layers = range(args.n_layers) if layers is None else layers
    block = args.attn_res_block_size
    stream = b * t * args.dim * ACT_BYTES
    # A layer's saved bytes depend on its kind and on how many AttnRes sources it reads.
    per_kind: dict[tuple[bool, bool, int], Saved] = {}
    saved, host, recompute, transient = 0.0, 0.0, 0, 0
    for i in layers:
        kind = (args.is_mla(i), args.is_moe(i), boundary_tensors(block, i))
        if kind not in per_kind:
            per_kind[kind] = layer_activation_bytes(args, i, b, t)
        layer = per_kind[kind]
        if _checkpointed(cfg, i):
            recompute = max(recompute, layer.recompute)
        else:
            saved += layer.total
            # Its backward runs on top of everything saved.
            transient = max(transient, layer.transient)
    if cfg.offload:
        # save_on_cpu copies what the checkpoints save, each layer's partial sum and doc ids;
        # the finished blocks reach a layer in a Python list, which the checkpoint keeps by
        # reference, so they stay on the GPU (the last list also feeds the final site).
        host += len(layers) * (stream + b * t * DOC_ID_BYTES)
        saved += (boundary_tensors(block, layers.stop) - 1) * stream
    else:
        # Every layer's incoming partial sum stays alive (the checkpoint input, or a block).
        saved += len(layers) * stream
    loss_phase = 0.0
    if loss:
        # The last partial sum, the final site's and norm's saves, the loss's hidden input (and,
        # chunked, its fp32 log-sum-exp and int64 labels).
        tail = (2 * stream + head_activation_bytes(args, b, t).total
                + (b * t * (LSE_BYTES + LABEL_BYTES) if cfg.loss_chunk else 0))
        loss_phase = loss_phase_bytes(cfg, b, t)
        if cfg.offload:
            # Copied too: the head's weight the loss keeps. The final site keeps its saves on
            # the device (FinalAttnResSite): the last partial sum stays there, by reference,
            # until the site's backward frees it, before the layers' backward.
            host += tail - stream + (args.vocab_size * args.dim * ACT_BYTES
                                     if cfg.loss_chunk else 0)
            loss_phase += stream
        else:
            saved += tail
    # With AC, backward holds one layer's recompute, its offloaded inputs brought back, and
    # the gradients of the residual sources it feeds (one per block, and the partial sum).
    n_blocks = math.ceil(layers.stop / block)
    back = stream + b * t * DOC_ID_BYTES if cfg.offload else 0
    backward = max(recompute + (n_blocks + 1) * stream + back if recompute else 0, transient)
    return Activations(held * saved + max(loss_phase, backward), held * host)


def estimate(cfg: PlanConfig, gpus: int, ep: int, counts: ParamCounts | None = None,
             activations: Activations | None = None) -> Estimate:
    """The training step on `gpus` GPUs, EP degree ep, CP degree cfg.cp (FSDP over all)."""
    counts = counts or parameter_counts(cfg.args)
    activations = activation_bytes(cfg) if activations is None else activations
    per_rank = counts.total / gpus
    layer = counts.largest_layer_dense + counts.largest_layer_experts / ep
    working = 10 * layer + 2 * counts.output
    parameters, gradients = PARAM_BYTES * per_rank, GRAD_BYTES * per_rank
    optimizer = ADAM_BYTES * per_rank
    peak = parameters + optimizer + working + max(activations.device, gradients)
    return Estimate(gpus, ep, parameters, gradients, optimizer, working, activations.device, peak,
                    cfg.cp, activations.host)


def bench_estimate(cfg: PlanConfig, counts: ParamCounts | None = None) -> Estimate:
    """bench/long_context.py's step on one GPU: bf16 weights and their gradients, no FSDP
    buffers, no optimizer."""
    counts = counts or parameter_counts(cfg.args)
    act = activation_bytes(cfg)
    weights = grads = BENCH_BYTES * counts.total
    return Estimate(1, 1, weights, grads, 0.0, 0.0, act.device,
                    weights + max(act.device, grads), cfg.cp, act.host)


def ep_degrees(gpus: int, n_experts: int) -> list[int]:
    """EP degrees a layout can use: powers of two dividing both the GPU and the expert count."""
    return [d for d in (2**i for i in range(16)) if d <= gpus and not gpus % d
            and not n_experts % d]


def cp_degrees(gpus: int, seq_len: int) -> list[int]:
    """CP degrees above 1 a layout can use: powers of two dividing the GPUs, each rank holding
    whole KDA chunks (the trainer's rule)."""
    return [d for d in (2**i for i in range(1, 16)) if d <= gpus and not gpus % d
            and not seq_len % (d * KDA_CHUNK_SIZE)]


def layouts(cfg: PlanConfig, gpus: int, counts: ParamCounts,
            activations: dict[int, Activations]) -> list[Estimate]:
    """Every EP layout, and every CP layout (CP runs without EP or KDA segments, as the trainer
    requires), of `gpus` GPUs; `activations` caches them per CP degree."""
    degrees = [(ep, 1) for ep in ep_degrees(gpus, cfg.args.n_experts)]
    if not cfg.args.seq_segment:
        degrees += [(1, cp) for cp in cp_degrees(gpus, cfg.seq_len)]
    rows = []
    for ep, cp in degrees:
        at = replace(cfg, cp=cp)
        if cp not in activations:
            activations[cp] = activation_bytes(at)
        rows.append(estimate(at, gpus, ep, counts, activations[cp]))
    return rows


def fewest_gpus(cfg: PlanConfig, gpu_mem_gb: float, step: int = 8, limit: int = 1 << 16,
                host_mem_gb: float = HOST_MEM_GB) -> Estimate | None:
    """The smallest multiple of `step` GPUs (1 to `step` first) with a layout that fits."""
    counts, activations = parameter_counts(cfg.args), {}
    candidates = [n for n in (1, 2, 4) if n < step] + list(range(step, limit + 1, step))
    for gpus in candidates:
        best = min(layouts(cfg, gpus, counts, activations), key=lambda e: e.peak)
        if best.fits(gpu_mem_gb, host_mem_gb):
            return best
    return None


def _row(e: Estimate, gpu_mem_gb: float, host_mem_gb: float) -> str:
    cells = [e.parameters, e.gradients, e.optimizer, e.working, e.activations, e.peak, e.host]
    fit = "yes" if e.fits(gpu_mem_gb, host_mem_gb) else "no"
    return (f"| {e.gpus} | {e.ep} | {e.cp} | {e.gpus // (e.ep * e.cp)} | "
            + " | ".join(f"{c / GB:.1f}" for c in cells) + f" | {fit} |")


def largest_recompute(cfg: PlanConfig) -> tuple[int, float]:
    """The checkpointed layer whose backward holds the most (its recompute's saved bytes and
    twice its largest tensor), and those bytes, at seq_len / cp positions."""
    t = cfg.seq_len // cfg.cp
    sizes = {}
    for i in range(cfg.args.n_layers):
        if _checkpointed(cfg, i):
            sizes[i] = layer_activation_bytes(cfg.args, i, cfg.local_batch, t).recompute
    if not sizes:
        return -1, 0.0
    layer = max(sizes, key=sizes.get)
    return layer, sizes[layer]


def print_plan(cfg: PlanConfig, gpus: int, gpu_mem_gb: float,
               host_mem_gb: float = HOST_MEM_GB) -> list[Estimate]:
    counts, activations = parameter_counts(cfg.args), {}
    rows = layouts(cfg, gpus, counts, activations)
    print(f"{counts.total / 1e9:.1f}B parameters ({counts.experts / 1e9:.1f}B routed experts); "
          f"{cfg.local_batch}×{cfg.seq_len} tokens a CP group; AC {cfg.ac_mode}; loss_chunk "
          f"{cfg.loss_chunk or 'none (full logits)'}; MoE token chunk "
          f"{cfg.args.moe_token_chunk or 'none'}; sequence segment "
          f"{cfg.args.seq_segment or 'none'}; activation offload "
          f"{'on' if cfg.offload else 'off'}; GB per GPU (fits: peak <= {HEADROOM:.0%} of "
          f"{gpu_mem_gb:g} GB and host <= {HOST_HEADROOM:.0%} of {host_mem_gb:.1f} GB)")
    print("| GPUs | EP | CP | dp | params | grads | optimizer | working | activations | peak "
          "| host | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in rows:
        print(_row(e, gpu_mem_gb, host_mem_gb))
    layer, held = largest_recompute(cfg)
    if layer >= 0:
        print(f"largest layer recompute in backward: layer {layer}, {held / GB:.1f} GB at "
              f"{cfg.seq_len // cfg.cp} positions a GPU (CP divides it)")
    best = fewest_gpus(cfg, gpu_mem_gb, host_mem_gb=host_mem_gb)
    if best is None:
        print("fits on no layout up to 65536 GPUs")
    else:
        print(f"fewest GPUs: {best.gpus} (EP {best.ep} × CP {best.cp} × dp "
              f"{best.gpus // (best.ep * best.cp)}), peak {best.peak / GB:.1f} GB, host "
              f"{best.host / GB:.1f} GB a GPU")
        if best.cp != cfg.cp:
            print(f"  set parallelism.context_parallel_degree = {best.cp} (the config has "
                  f"{cfg.cp}): one GPU's share of a sequence does not fit with {cfg.cp}")
    return rows + ([best] if best else [])


def validate(cfg: PlanConfig, steps: int) -> dict:
    """Train `steps` steps of the config on one CUDA GPU under FSDP2 (a one-rank mesh, so the
    memory follows the cluster's plan) and compare the measured peak with estimate(gpus=1)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    if not torch.cuda.is_available():
        raise SystemExit("error: --validate needs a CUDA GPU")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = TitanMoE(cfg.args)
    if cfg.ac_mode != "none":
        ac = ActivationCheckpoint(mode=cfg.ac_mode, selective_ac_option=cfg.selective_ac_option)
        apply_ac(model, ac, op_sac_save_list=OP_SAC_SAVE_LIST)
    apply_fsdp(model, mesh, torch.bfloat16, torch.float32)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(cfg.args.vocab_size, (cfg.local_batch, cfg.seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    planned = estimate(cfg, 1, 1)
    result = {"measured_gb": measured / GB, "planned_gb": planned.peak / GB,
              "ratio": planned.peak / measured, "plan": asdict(planned), "steps": steps}
    print(f"measured peak {measured / GB:.2f} GB, planned {planned.peak / GB:.2f} GB, "
          f"planned / measured = {result['ratio']:.3f} (target within 0.85 .. 1.15)")
    return result
