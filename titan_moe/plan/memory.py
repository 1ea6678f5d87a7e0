"""Per-GPU memory of a training step under FSDP2 × expert-parallel × context-parallel layouts,
and the long-context bench's step (`bench_estimate`). The layouts weighed and the fewest GPUs a
model fits on are layouts.py's; what a layer saves, saved.py's.

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
larger of the two ends is the peak. Per-layer saved activations are counted on the meta device
(saved.py, which says what it runs and where the count is approximate). Approximate here too:
MLA's gathered prefix under CP (not counted), allocator fragmentation (in the 10% headroom).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.pipeline import boundary_tensors
from titan_moe.plan.config import PlanConfig
from titan_moe.plan.saved import Saved, head_activation_bytes, layer_activation_bytes

GB = 1e9
GIB = 2**30
ACT_BYTES = 2  # bf16 activations under FSDP2's bf16 param policy
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
BENCH_BYTES = 2  # bench/long_context.py: bf16 weights and gradients, no master copy, no optimizer
DOC_ID_BYTES, LABEL_BYTES, LSE_BYTES = 4, 8, 4  # int32 doc ids, int64 labels, fp32 log-sum-exp
HEADROOM = 0.9  # of the GPU's memory: allocator fragmentation, NCCL buffers, CUDA context
HOST_MEM_GB = 128 * GIB / GB  # host RAM of the one-H200 machine the long-context bench runs on
HOST_HEADROOM = 0.9  # of the host's memory: the process, the data loader, the page cache


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
