"""SimpleFSDP (torchtitan 0.2.2 `experiments/simple_fsdp`): sharding that the compiler schedules.

Every parameter becomes a DTensor sharded over the dp mesh, and a parametrization all-gathers it
where it is read (its gradient is reduce-scattered by the DTensor backward). Compiled as one
graph (`compile.enable`), Inductor sees every all-gather and reduce-scatter and, with
`parallelism.simple_fsdp_passes`, buckets and reorders them (`auto_bucketing`, or
`transformer_block_bucketing` with one bucket per decoder layer). Eager, it is correct but
unbucketed. The fp32 islands (fp32_modules.py) get their own fp32 policy here too.
"""

import types

import torch
import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.experiments.simple_fsdp.backend import get_compile_backend_with_passes
from torchtitan.experiments.simple_fsdp.simple_fsdp import (
    MixedPrecisionPolicy,
    data_parallel,
    disable_active_parametrization,
)

from titan_moe.model.model import TitanMoE
from titan_moe.parallel.fp32_modules import FP32_MODULES, fp32_islands


def layer_buckets(model: TitanMoE) -> list[list[str] | str]:
    """transformer_block_bucketing's plan: the embedding, each layer, then the head, by FQN."""
    return ["tok_embeddings", *[f"layers.{i}" for i in model.layers],
            ["final_site", "norm", "output"]]


def apply_simple_fsdp(
    model: TitanMoE,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> nn.Module:
    if parallel_dims.dp_replicate_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.fsdp_enabled else ["dp_replicate"]
        mode = "hybrid_shard" if parallel_dims.fsdp_enabled else "replicate"
    else:
        names, mode = ["fsdp"], "fully_shard"
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        model = shard_simple_fsdp(model, parallel_dims.get_mesh(names), mode, param_dtype,
                                  reduce_dtype)
    if job_config.compile.enable and "model" in job_config.compile.components:
        reshard = job_config.parallelism.fsdp_reshard_after_forward != "never"
        model = compile_simple_fsdp(model, job_config.compile.backend,
                                    job_config.parallelism.simple_fsdp_passes, reshard)
    return model


def shard_simple_fsdp(model: TitanMoE, mesh, mode: str, param_dtype: torch.dtype,
                      reduce_dtype: torch.dtype) -> TitanMoE:
    """SimpleFSDP's data_parallel over `mesh`, the fp32 islands first with an fp32 policy."""
    if fp32_islands(True, param_dtype):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in [m for m in model.modules() if isinstance(m, FP32_MODULES)]:
            data_parallel(module, mesh, mode=mode, mp_policy=fp32)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = data_parallel(model, mesh, mode=mode, mp_policy=policy)
    _init_on_shards(model)
    return model


def compile_simple_fsdp(model: TitanMoE, backend: str, passes: str, reshard: bool) -> nn.Module:
    """The whole model in one fullgraph compile, with the bucketing pass `passes` (or none)."""
    compile_config = types.SimpleNamespace(
        backend=backend, graph_passes=None if passes == "none" else passes
    )
    compiled_backend = get_compile_backend_with_passes(compile_config, reshard,
                                                       layer_buckets(model))
    return torch.compile(model, backend=compiled_backend, fullgraph=True)


def _init_on_shards(model: TitanMoE) -> None:
    """The trainer calls model.init_weights(); under the parametrization a parameter read is an
    all-gathered copy, so initialisation must write the shards (as torchtitan's SimpleFSDP
    models do by overriding init_weights)."""
    init = model.init_weights

    def init_weights(*args, **kwargs) -> None:
        with disable_active_parametrization():
            init(*args, **kwargs)

    model.init_weights = init_weights
