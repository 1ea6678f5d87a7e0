"""The pre-start audit: torchtitan options the titan_moe train spec does not read.

torchtitan's Trainer hands these to code titan_moe replaces (parallelize, FSDP, MoE, the
checkpointer's HF adapter), so set they would be ignored or fail after torchrun starts; here each
is one ConfigError before it starts. config.py calls `check_titan_moe_reads` on a parsed
titan_moe JobConfig.
"""

import dataclasses
import importlib.util
from typing import Any

import torchtitan.config.job_config as tt_job_config

from titan_moe.model.args import ConfigError

# Where a rejected torchtitan quantization option points instead.
_TITAN_MOE_FLOAT8 = "titan_moe's quantized training is [float8] (enable, moe)"


def _check_tensor_parallel(job_config: Any) -> None:
    """parallelize.py refuses TP only after torchrun starts; async TP needs TP."""
    parallelism = job_config.parallelism
    for name in ("tensor_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(parallelism, name)
        if value > 1:
            raise ConfigError(
                f"parallelism.{name} = {value} is not supported by titan_moe; allowed: 1 (use "
                "data_parallel_shard_degree, expert_parallel_degree, context_parallel_degree or "
                "pipeline_parallel_degree)")
    if parallelism.enable_async_tensor_parallel:
        raise ConfigError("parallelism.enable_async_tensor_parallel = true needs tensor "
                          "parallelism, which titan_moe does not support; allowed: false")


def _changed_fields(value: Any, default: Any, path: str) -> list[str]:
    """The dotted names of the leaves of a config dataclass that differ from its defaults."""
    if not dataclasses.is_dataclass(value):
        return [] if value == default else [path]
    return [name for f in dataclasses.fields(value)
            for name in _changed_fields(getattr(value, f.name), getattr(default, f.name),
                                        f"{path}.{f.name}")]


def _check_model_converters(job_config: Any) -> None:
    """torchtitan registers its float8 and MX converters under model.converters: they would
    swap titan_moe's Linears and GroupedExperts on top of [float8]'s conversion (an unknown name
    is a KeyError inside torchrun). The [quantize] section is read only by them."""
    converters = job_config.model.converters
    if converters:
        raise ConfigError(f"model.converters = {converters} is not supported by titan_moe "
                          f"({_TITAN_MOE_FLOAT8}); allowed: []")
    changed = _changed_fields(job_config.quantize, tt_job_config.Quantize(), "quantize")
    if changed:
        raise ConfigError(f"{changed[0]} is set, but [quantize] is read only by torchtitan's "
                          f"model.converters, which titan_moe does not support "
                          f"({_TITAN_MOE_FLOAT8}); leave [quantize] at its defaults")


def _check_fault_tolerance(job_config: Any) -> None:
    # torchtitan's Trainer builds no torchft manager; only the TensorBoard folder would change.
    if job_config.fault_tolerance.enable:
        raise ConfigError("fault_tolerance.enable = true is not supported by titan_moe (the "
                          "trainer builds no torchft manager); allowed: false")


def _check_memory_estimation(job_config: Any) -> None:
    # No torchtitan code path of the Trainer reads it.
    if job_config.memory_estimation.enable:
        raise ConfigError("memory_estimation.enable = true is not read by titan_moe's trainer; "
                          "allowed: false (estimate memory with python -m titan_moe.plan)")


def _check_hf_checkpoint(job_config: Any) -> None:
    """HF safetensors conversion needs a state-dict adapter; the titan_moe train spec has none,
    and torchtitan's checkpointer asserts on one after torchrun starts."""
    checkpoint = job_config.checkpoint
    for name in ("initial_load_in_hf", "initial_load_in_hf_quantized", "last_save_in_hf"):
        if getattr(checkpoint, name):
            raise ConfigError(f"checkpoint.{name} = true is not supported by titan_moe (no "
                              "HF state-dict adapter; checkpoints are DCP); allowed: false")


_COMPILE_COMPONENTS = ("model", "loss")


def _check_compile_components(job_config: Any) -> None:
    # Anything else in the list is read by nothing.
    unknown = [c for c in job_config.compile.components if c not in _COMPILE_COMPONENTS]
    if unknown:
        raise ConfigError(f"compile.components: {unknown[0]!r} is unknown; allowed: "
                          f"{', '.join(_COMPILE_COMPONENTS)}")


def _check_activation_checkpoint(job_config: Any) -> None:
    """torchtitan's apply_ac raises on a bad selective option and asserts that memory_budget
    runs compiled, both after torchrun starts."""
    ac, compile_config = job_config.activation_checkpoint, job_config.compile
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {option!r}: allowed 'op' "
                          "or a layer frequency (an integer >= 0; 0 and 1: every layer)")
    if ac.mode == "memory_budget" and not (compile_config.enable
                                           and "model" in compile_config.components):
        raise ConfigError("activation_checkpoint.mode = 'memory_budget' needs compile.enable = "
                          "true with 'model' in compile.components (the budget is the compiler's "
                          "partitioner's)")


def _check_cpu_offload(job_config: Any) -> None:
    # titan_moe's FSDP units take no CPUOffloadPolicy: the parameters torchtitan initialises on
    # the host would stay there while the batches are on the GPU.
    if job_config.training.enable_cpu_offload:
        raise ConfigError("training.enable_cpu_offload = true is not supported by titan_moe "
                          "(its FSDP has no CPU offload policy); allowed: false (for activations: "
                          "training.activation_offload)")


def _check_optimizer_in_backward(job_config: Any) -> None:
    # Each parameter would step as its gradient arrives: before the gradient clip and before the
    # step guard can skip a non-finite step.
    if job_config.optimizer.early_step_in_backward:
        raise ConfigError("optimizer.early_step_in_backward = true is not supported by titan_moe "
                          "(the step would run before training.max_norm clips and before a "
                          "non-finite step is skipped); allowed: false")


def _check_fsdp_reshard(job_config: Any) -> None:
    # FSDP2 units reshard after forward (parallelize.apply_fsdp); only SimpleFSDP reads the option.
    parallelism = job_config.parallelism
    reshard = parallelism.fsdp_reshard_after_forward
    if reshard == "never" and parallelism.sharding == "fsdp2":
        raise ConfigError("parallelism.fsdp_reshard_after_forward = 'never' is not read with "
                          "parallelism.sharding = 'fsdp2' (its layers reshard after forward); "
                          "allowed: 'default', 'always', or sharding = 'simple_fsdp'")


def _check_expert_comm_backend(job_config: Any) -> None:
    # titan_moe's EP dispatches with its own all-to-all (parallel/expert_parallel.py).
    backend = job_config.parallelism.expert_parallel_comm_backend
    if backend != "standard":
        raise ConfigError(f"parallelism.expert_parallel_comm_backend = {backend!r} is not "
                          "supported by titan_moe (its EP has its own all-to-all); allowed: "
                          "'standard'")


def _check_moe_force_load_balance(job_config: Any) -> None:
    # torchtitan's MoE reads it; titan_moe's router balances with Quantile Balancing instead.
    if job_config.debug.moe_force_load_balance:
        raise ConfigError("debug.moe_force_load_balance = true is not read by titan_moe's MoE "
                          "(Quantile Balancing balances the experts); allowed: false")


def _check_pipeline_stage_layers(job_config: Any) -> None:
    # titan_moe's stages are cut on AttnRes blocks, balanced by cost (parallel/pipeline.py).
    parallelism = job_config.parallelism
    if parallelism.pipeline_parallel_degree <= 1:
        return
    for name in ("pipeline_parallel_first_stage_less_layers",
                 "pipeline_parallel_last_stage_less_layers"):
        value = getattr(parallelism, name)
        if value != 1:
            raise ConfigError(
                f"parallelism.{name} = {value} is not read by titan_moe (its stages are cut on "
                "AttnRes blocks, balanced by cost); allowed: 1 (size stages with "
                "pipeline_parallel_layers_per_stage)")


def _check_wandb(job_config: Any) -> None:
    # torchtitan imports wandb only when it builds the logger, after torchrun starts.
    if job_config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb = true needs the wandb package, which is not "
                          "installed; allowed here: false (metrics.enable_tensorboard logs)")


_OPTIMIZERS = ("Adam", "AdamW")


def _check_optimizer_name(job_config: Any) -> None:
    # torchtitan's build_optimizers raises NotImplementedError for others, after torchrun starts.
    name = job_config.optimizer.name
    if name not in _OPTIMIZERS:
        raise ConfigError(f"optimizer.name = {name!r} is not supported; allowed: "
                          f"{', '.join(_OPTIMIZERS)}")


def _check_context_parallel_exchange(job_config: Any) -> None:
    """titan_moe's CP gives each rank a contiguous slab and exchanges the KDA state and conv halo
    and the MLA latent prefix with its own collectives (parallel/context_parallel.py); torchtitan's
    SDPA load balancer and kv rotation are never applied."""
    parallelism = job_config.parallelism
    if parallelism.context_parallel_degree <= 1:
        return
    balancer = parallelism.context_parallel_load_balancer
    if balancer not in ("headtail", None):
        raise ConfigError(f"parallelism.context_parallel_load_balancer = {balancer!r} is not read "
                          "by titan_moe's context parallelism (contiguous slabs); allowed: "
                          "'headtail' (the default, not applied either) or None")
    rotate = parallelism.context_parallel_rotate_method
    if rotate != "allgather":
        raise ConfigError(f"parallelism.context_parallel_rotate_method = {rotate!r} is not read "
                          "by titan_moe's context parallelism (its own state exchange); allowed: "
                          "'allgather' (the default, not applied either)")


def _check_checkpoint_async(job_config: Any) -> None:
    # checkpoint_verify.VerifiedCheckpoints refuses it too, but only after torchrun starts and
    # the model is built.
    checkpoint = job_config.checkpoint
    if checkpoint.enable and checkpoint.async_mode != "disabled":
        raise ConfigError(f"checkpoint.async_mode = {checkpoint.async_mode!r} is not supported: "
                          "checkpoints are verified by a manifest written after the save "
                          "completes; allowed: 'disabled'")


def _check_comm_mode(job_config: Any) -> None:
    # torchtitan's own main builds the trainer and stops in this mode (its model is not fully
    # initialised); titan_moe's run trains on, and the checkpoint save fails on LocalTensors.
    if job_config.comm.mode == "local_tensor":
        raise ConfigError("comm.mode = 'local_tensor' is not supported by titan_moe's training "
                          "run (torchtitan only builds the trainer in it); allowed: 'default', "
                          "'fake_backend'")


def check_titan_moe_reads(job_config: Any) -> None:
    """The torchtitan options above, for the titan_moe spec (another spec may support them)."""
    for check in (_check_tensor_parallel, _check_model_converters, _check_fault_tolerance,
                  _check_memory_estimation, _check_hf_checkpoint, _check_compile_components,
                  _check_activation_checkpoint, _check_cpu_offload, _check_optimizer_in_backward,
                  _check_fsdp_reshard, _check_expert_comm_backend, _check_moe_force_load_balance,
                  _check_pipeline_stage_layers, _check_wandb, _check_optimizer_name,
                  _check_context_parallel_exchange, _check_checkpoint_async,
                  _check_comm_mode):
        check(job_config)
