"""Apply activation checkpointing, per-layer compile and FSDP2 to a TitanMoE, from the TOML.

Parallelism is applied from outside the model (torchtitan style): the model code knows nothing
of meshes. Order matters: AC wraps a layer, compile wraps the AC-wrapped layer, FSDP shards last.
"""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac

from titan_moe.model.model import TitanMoE


def parallelize_titan_moe(
    model: TitanMoE, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    unsupported = {"tp": parallel_dims.tp_enabled, "pp": parallel_dims.pp_enabled,
                   "cp": parallel_dims.cp_enabled, "ep": parallel_dims.ep_enabled}
    for name, enabled in unsupported.items():
        if enabled:
            raise ValueError(
                f"parallelism.{_DEGREE_FIELD[name]} > 1 is not supported yet by titan_moe; "
                "allowed: 1 (use data_parallel_shard_degree for FSDP)"
            )
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model)
    if compile_model:
        for layer_id, layer in model.layers.named_children():
            model.layers.register_module(
                layer_id, torch.compile(layer, backend=job_config.compile.backend, fullgraph=True)
            )
        if getattr(model, "vision", None) is not None:  # the vision blocks, compiled alike
            for block_id, block in model.vision.blocks.named_children():
                model.vision.blocks.register_module(block_id, torch.compile(
                    block, backend=job_config.compile.backend, fullgraph=True))
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
        )
    return model


_DEGREE_FIELD = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
                 "cp": "context_parallel_degree", "ep": "expert_parallel_degree"}


def apply_fsdp(model: TitanMoE, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """One FSDP unit per decoder layer, one for the vision tower (if any), one for the embedding,
    one for the head, then the root.

    Gradient division is left to the trainer, which scales the loss by the global token count.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if getattr(model, "vision", None) is not None:  # the vision tower is a unit of its own
        fully_shard(model.vision, mesh=mesh, mp_policy=policy)
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard([model.final_site, model.norm, model.output], mesh=mesh, mp_policy=policy,
                reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
