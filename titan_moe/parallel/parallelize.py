"""Apply context parallelism, float8, expert parallelism, activation checkpointing, per-block
compile and sharding (FSDP2 or SimpleFSDP) to a TitanMoE, from the TOML, on torchtitan's
ParallelDims.

Parallelism is applied from outside the model (torchtitan style): the model code knows nothing
of meshes. Order matters: CP patches the sequence-mixing steps of the mixers (the cp mesh), float8
swaps modules, EP shards the experts over the ep mesh, AC wraps a layer, compile wraps what runs
between FSDP units, sharding comes last.

    dense parameters     FSDP2 over the dp mesh (dp_replicate × fsdp), one unit per layer;
                         torchtitan's fsdp dim is dp_shard × cp, so the gradients of the cp
                         ranks' shares of a sequence are summed with the data-parallel ones
    routed experts       Shard(0) over ep, then FSDP2 over efsdp (the dp ranks left over)
    fp32 islands         AttnRes queries/gains, the router, every RMSNorm: one FSDP unit per layer
                         with an fp32 policy, so mixed_precision_param = bf16 never rounds them
                         (spec §2, §5); QB buffers are buffers, never cast.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac

from compile_passes.inductor_settings import inductor_settings
from compile_passes.registry import PASS_NAMES, check_pass_names, inductor_options
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.model import TitanMoE
from titan_moe.model.moe import GroupedExperts, LatentMoE
from titan_moe.model.situ_glu import SiTUGLU
from titan_moe.parallel.context_parallel import apply_context_parallel, has_context_parallel
from titan_moe.parallel.expert_parallel import apply_expert_parallel
from titan_moe.parallel.fp32_modules import FP32_MODULES, fp32_islands
from titan_moe.parallel.pipeline import StageModule
from titan_moe.parallel.simple_fsdp import apply_simple_fsdp

# Selective op-level AC keeps these outputs and recomputes the rest (torchtitan's llama list
# plus the grouped GEMM of the routed experts).
OP_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}

_DEGREE_FIELD = {"tp": "tensor_parallel_degree", "etp": "expert_tensor_parallel_degree"}


def parallelize_titan_moe(
    model: TitanMoE | StageModule, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Parallelize a whole model, or one pipeline stage of it (parallel/pipeline_schedule.py
    calls this per stage)."""
    _reject_unsupported(parallel_dims)
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.get_mesh("cp").get_group())
    _apply_float8(model, job_config)
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=OP_SAC_SAVE_LIST, base_folder=job_config.job.dump_folder)
    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
    shard = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    simple_fsdp = job_config.parallelism.sharding == "simple_fsdp"
    if _has_grad_sinks(model) and (shard or simple_fsdp):
        # FSDP2 wraps an fp32 site unit's inputs in an autograd function that materialises the
        # None gradients a sinked site returns for the blocks as zeros (a [T, d] tensor each);
        # simple_fsdp compiles the sites.
        raise ValueError("titan_moe.attn_res_grad_sink is for one GPU without data parallelism "
                         "(parallelism.data_parallel_shard_degree = 1, "
                         "data_parallel_replicate_degree = 1, sharding = 'fsdp2'); set "
                         "attn_res_grad_sink = false to shard")
    if simple_fsdp:
        return apply_simple_fsdp(model, parallel_dims, job_config, param_dtype, reduce_dtype)
    if compile_model:
        units = fsdp_units(model, parallel_dims.ep_enabled, fp32_islands(shard, param_dtype))
        ac = job_config.activation_checkpoint
        op_sac = ac.mode == "selective" and ac.selective_ac_option == "op"
        apply_compile(model, job_config.compile.backend, units, job_config.compile.passes,
                      job_config.compile.fullgraph, whole_layers=op_sac,
                      cudagraphs=job_config.compile.cudagraphs,
                      inductor=inductor_settings(job_config.compile.inductor, "compile.inductor"))
    if shard:
        dp_mesh = parallel_dims.get_mesh(
            ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
        expert_mesh = parallel_dims.get_mesh("efsdp") if parallel_dims.ep_enabled else None
        apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype, expert_mesh)
    return model


def _reject_unsupported(parallel_dims: ParallelDims) -> None:
    enabled = {"tp": parallel_dims.tp_enabled, "etp": parallel_dims.etp_enabled}
    for name, on in enabled.items():
        if on:
            raise ValueError(
                f"parallelism.{_DEGREE_FIELD[name]} > 1 is not supported by titan_moe; allowed: "
                "1 (use data_parallel_shard_degree for FSDP, expert_parallel_degree for EP, "
                "context_parallel_degree for long sequences, pipeline_parallel_degree for PP)"
            )


def _apply_float8(model: nn.Module, job_config: JobConfig) -> None:
    cfg = getattr(job_config, "float8", None)
    if cfg is None:
        return
    # Imported only when asked for: torchao's import prints load failures of its CUDA
    # extensions (on every machine without them), which every run would otherwise log.
    from float8 import convert_dense_linears, convert_routed_experts

    if cfg.enable:
        convert_dense_linears(model, cfg)
    if cfg.moe:
        convert_routed_experts(model, cfg)


def fsdp_units(model: TitanMoE, expert_parallel: bool, fp32: bool) -> set[nn.Module]:
    """The modules inside the decoder layers that become FSDP units of their own."""
    units: set[nn.Module] = set()
    for layer in model.layers.values():
        for module in layer.modules():
            if (fp32 and isinstance(module, FP32_MODULES)) or (
                expert_parallel and isinstance(module, GroupedExperts)
            ):
                units.add(module)
    return units


def apply_compile(
    model: TitanMoE,
    backend: str,
    units: set[nn.Module],
    passes: Sequence[str] = PASS_NAMES,
    fullgraph: bool = True,
    whole_layers: bool = False,
    cudagraphs: bool = False,
    inductor: dict[str, object] | None = None,
) -> None:
    """torch.compile per sublayer of every decoder layer (its two AttnRes sites, two RMSNorms,
    mixer and FFN) and per ViT block, with our Inductor passes; around nested FSDP units instead.

    Why sublayers, not whole decoder layers as torchtitan compiles its identical blocks: our
    layers differ (KDA or MLA mixer, dense or MoE FFN, and the number of AttnRes sources grows
    with depth), so whole layers are one distinct graph each, 16 for the proxy flavor, and their
    cold compile took over 5 minutes on the H200. Sublayers of one kind are the same graph in
    every layer: one KDA, one MLA, one dense FFN, one MoE graph, and per source count one small
    AttnRes graph (13 graphs instead of 16 for a toy proxy, first step 50 s instead of 308 s on
    CPU). The glue left eager is two residual adds per layer. A full-AC wrapper stays eager
    around its layer's compiled sublayers; op-level selective AC needs its policy inside the
    compiled graph, so `whole_layers` (set for it) compiles each layer, wrapper and all, whole.
    A sublayer run by checkpointed pieces (MoE and dense-FFN token chunks, KDA and MLA sequence
    segments) compiles one piece's function, the loop over the pieces eager: compiled whole, its
    backward held several pieces' recomputes at once (`_compile_around` has the measurements).

    An FSDP unit's hooks break a fullgraph trace, so a sublayer holding units is compiled
    piecewise: every maximal submodule free of units is compiled whole, and a unit's own
    `forward` is compiled (its FSDP hooks stay outside, on __call__). The EP experts stay eager
    (their all-to-all splits are read on the host). The passes (`compile.passes`) and the
    `inductor` options (`compile.inductor`) are given through `torch.compile(options=...)`, so
    they apply to these compiles only. Under context parallelism a KDA or MLA mixer (or a whole
    layer holding one) compiles without fullgraph: its sequence steps are eager graph breaks
    (context_parallel.py says why).

    `cudagraphs` (CUDA only) replays each compiled region as CUDA graphs (Inductor's cudagraph
    trees, what mode="reduce-overhead" turns on): a region's launches cost one graph launch, so
    the host stops setting the step's pace. The KDA and MLA mixers switch to the static document
    layout (ops/static_documents.py: fixed shapes, no host sync, graph_sequence_bound sequences
    a batch at most) for fla's kernels and Flash's varlen attention. The training loop calls
    `torch.compiler.cudagraph_mark_step_begin()` before each step.
    """
    check_pass_names(passes)
    if passes and backend != "inductor":
        raise ValueError(
            f"compile.passes {list(passes)} are Inductor passes; compile.backend is {backend!r} "
            "(allowed with passes: 'inductor'; or set compile.passes = [])"
        )
    if inductor and backend != "inductor":
        raise ValueError(f"compile.inductor {inductor} are Inductor options; compile.backend is "
                         f"{backend!r} (allowed with them: 'inductor')")
    if cudagraphs and backend != "inductor":
        raise ValueError(f"compile.cudagraphs needs compile.backend = 'inductor', got {backend!r}")
    if cudagraphs:
        for module in model.modules():
            mixer = isinstance(module, (KimiDeltaAttention, GatedMLA))
            if not mixer or has_context_parallel(module):
                continue
            if isinstance(module, KimiDeltaAttention):
                module.sequence_recurrence = functools.partial(
                    type(module).sequence_recurrence, static_layout=True)
            else:
                module.attention = functools.partial(type(module).attention, static_layout=True)
    options = (inductor_options(passes) | (inductor or {})
               | ({"triton.cudagraphs": True} if cudagraphs else {}))
    compile_whole = functools.partial(torch.compile, backend=backend, fullgraph=fullgraph,
                                      options=options or None)
    compile_pieces = functools.partial(compile_whole, fullgraph=False)

    def compile_fn(target):
        # A mixer under context parallelism breaks its graph around its eager collectives.
        module = getattr(target, "__self__", target)
        pieces = isinstance(module, nn.Module) and has_context_parallel(module)
        return (compile_pieces if pieces else compile_whole)(target)

    if cudagraphs and not whole_layers:
        # Eager glue's outputs would be copied into every graph that reads them: the residual
        # sums (a block is read by every later AttnRes site) and the embedding.
        residual_add = compile_whole(_residual_add)
        for layer in model.layers.values():
            inner = (layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper)
                     else layer)
            inner.residual_add = residual_add
        embedding = getattr(model, "tok_embeddings", None)
        if embedding is not None and embedding not in units:
            model.tok_embeddings = compile_fn(embedding)
    if _has_grad_sinks(model) and whole_layers:
        raise ValueError("titan_moe.attn_res_grad_sink needs the AttnRes sites eager, and a "
                         "whole-layer compile (activation_checkpoint.mode = 'selective', op "
                         "level) traces them; allowed: per-sublayer compile (full or no AC) or "
                         "attn_res_grad_sink = false")
    for layer_id, layer in model.layers.named_children():
        if whole_layers:
            model.layers.register_module(layer_id, _compile_around(layer, compile_fn, units))
            continue
        inner = layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer
        for name, child in list(inner.named_children()):
            if isinstance(child, AttnResSite) and child.grad_sink:
                continue  # its backward adds into the blocks' sinks: eager (attn_res_sink.py)
            inner.register_module(name, _compile_around(child, compile_fn, units))
    vision = getattr(model, "vision", None)
    if vision is not None:
        for block_id, block in vision.blocks.named_children():
            vision.blocks.register_module(block_id, compile_fn(block))
    # Sublayers of one class share a code object, and each AttnRes source count is a recompile
    # of AttnResSite.forward; under fullgraph, passing dynamo's default limit (8) is an error.
    # A segmented mixer's _segment is one code object for every layer, each compiling up to
    # three variants: the first segment (no state or taps carried in), the later ones, and a
    # shorter last one; MLA's _queries and _output two (a segment and a shorter last one).
    n_layers = len(model.layers)
    segmented = any(getattr(m, "seq_segment", 0) for m in model.modules()
                    if isinstance(m, (KimiDeltaAttention, GatedMLA)))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               (3 if segmented else 1) * n_layers + 2)


def _has_grad_sinks(model: nn.Module) -> bool:
    """Whether the model's AttnRes sites add into gradient sinks (model/attn_res_sink.py)."""
    return any(isinstance(m, AttnResSite) and m.grad_sink for m in model.modules())


def _residual_add(partial: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    return partial + update


def _compile_around(
    module: nn.Module, compile_fn: Callable[..., Any], units: set[nn.Module]
) -> nn.Module:
    if not any(m in units for m in module.modules()):
        if isinstance(module, (LatentMoE, SiTUGLU)) and module.token_chunk:
            # By token chunks (model/token_chunks.py), one compiled graph a chunk, the loop over
            # them eager. Compiled whole, Inductor's backward of a MoE layer held three chunks'
            # recomputes at its peak (on CPU, d = 256, chunks of 1024: the backward's peak grew
            # 11 kB a token, the eager loop's 1 kB, its input gradient), so the chunks bounded
            # nothing; each chunk's own backward graph frees its recompute before the next.
            module._tokens = compile_fn(module._tokens)
            return module
        if isinstance(module, (KimiDeltaAttention, GatedMLA)) and module.seq_segment:
            # By segments, the same way: one compiled graph a segment, the loop (KDA's state and
            # conv taps passed on, MLA's latents sliced per prefix) eager, and MLA's latent
            # projection (one GEMM) eager before it. Compiled whole, a KDA mixer's backward held
            # several segments' recomputes at once: over 4 -> 8 segments of 128 (d = 256, CPU)
            # its peak grew by 18.7 fp32 rows of d a position, the eager loop's and this one's
            # by 1; MLA's by 25.1 against 6.3 then (its last segment's keys grew with T). A
            # KDA mixer over one segment or less runs whole, also compiled. An MLA mixer over
            # one segment or less runs _segment, compiled; by segments, its attention by key
            # segments (ops/key_segment_attention.py) stays eager, a loop over as many key
            # segments as the prefix has, and the query and output projections around it are
            # compiled, of static shapes.
            module._segment = compile_fn(module._segment)
            if isinstance(module, KimiDeltaAttention):
                module._forward_whole = compile_fn(module._forward_whole)
            else:
                module._queries = compile_fn(module._queries)
                module._output = compile_fn(module._output)
            return module
        return compile_fn(module)
    if module in units:
        if not isinstance(module, GroupedExperts):
            module.forward = compile_fn(module.forward)
        return module
    for name, child in list(module.named_children()):
        module.register_module(name, _compile_around(child, compile_fn, units))
    return module


def apply_fsdp(
    model: TitanMoE,
    mesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    expert_mesh=None,
) -> None:
    """FSDP2 units: the vision tower (if any), per layer (experts and fp32 islands first, as units
    of their own), the embedding, the head, then the root. A pipeline stage (parallel/pipeline.py)
    holds the vision tower and the embedding on the first stage and the head on the last only.

    Gradient division is left to the trainer, which scales the loss by the global token count.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32_policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    islands = fp32_islands(True, param_dtype)
    if getattr(model, "vision", None) is not None:
        fully_shard(model.vision, mesh=mesh, mp_policy=policy)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy)
    for layer in model.layers.values():
        if expert_mesh is not None:
            for experts in (m for m in layer.modules() if isinstance(m, GroupedExperts)):
                fully_shard(experts, mesh=expert_mesh, mp_policy=policy,
                            shard_placement_fn=_expert_placement(expert_mesh.size()))
        if islands:
            fp32 = [m for m in layer.modules() if isinstance(m, FP32_MODULES)]
            fully_shard(fp32, mesh=mesh, mp_policy=fp32_policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if model.output is not None:
        head = [model.final_site, model.norm, model.output]
        if islands:
            fully_shard([model.final_site, model.norm], mesh=mesh, mp_policy=fp32_policy,
                        reshard_after_forward=False)
            head = [model.output]
        fully_shard(head, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)


def _expert_placement(efsdp: int):
    """Shard expert weights over efsdp on the expert dim while each rank keeps whole experts,
    else on the input dim (more efsdp ranks than local experts)."""

    def placement(param: nn.Parameter) -> Shard:
        local_experts = param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]
        return Shard(0) if local_experts >= efsdp else Shard(1)

    return placement
