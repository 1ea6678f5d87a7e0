"""The titan_moe job config: torchtitan's JobConfig plus our sections, validated at the boundary.

    JobConfig = torchtitan JobConfig
              + training.device   "auto" | "cpu" | "cuda"
              + [titan_moe]       one `T | None = None` field per model-arg field of the flavor
    model args = FLAVORS[model.flavor] with every non-None titan_moe.<field> substituted
                 (the model args' `update_from_config` applies them)

Precedence is torchtitan's: CLI (`--titan_moe.n_layers 4`) > TOML (`[titan_moe] n_layers = 4`)
> flavor. Every bad input raises one `ConfigError` whose message is a single line naming the
offending key; `parse_job_config_or_exit` prints it and exits 2. Checked here: the config file
exists and parses, sections and keys exist (the message lists the allowed keys), values have the
field's type, `training.seq_len` is a multiple of the KDA chunk, an explicit dataset path holds
readable, non-empty data files, the model args accept the overrides, the profiler schedule fits,
step counts, rates and intervals are in range, the parallel degrees fit the process count and the
global batch (torchtitan's ParallelDims rules), pipeline parallelism's schedule, micro-batches and
stage count fit and nothing it does not support is on, `compile.passes` names known passes on the
Inductor backend, the processes per node fit the devices, and no torchtitan option that the
titan_moe spec does not read is set (tensor parallelism, model converters and [quantize], fault
tolerance, memory estimation, HF checkpoints, a custom config module, CPU offload, the optimizer
in backward, ...: config_audit.py's `check_titan_moe_reads`), where it would be ignored or fail
inside torchrun.
Run `python -m titan_moe.train.config --job.config_file F [--section.key value ...]` to check only.
"""

import copy
import dataclasses
import importlib
import math
import os
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torchtitan.config as tt_config
import torchtitan.config.job_config as tt_job_config
from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

from compile_passes.inductor_settings import inductor_settings
from compile_passes.registry import PASS_NAMES, check_pass_names
from titan_moe.config_types import cli_values_match, type_name, value_matches
from titan_moe.data.dataloader import check_data_source
from titan_moe.data.images import DIGITS_HELD_OUT
from titan_moe.data.tokenizer import ASSETS_DIR
from titan_moe.model.args import FLAVORS, ConfigError, TitanMoEArgs, model_args
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE
from titan_moe.parallel.pipeline_schedule import (
    PIPELINE_SCHEDULES,
    single_stage_schedule,
    stages_per_rank,
)
from titan_moe.train.config_audit import check_titan_moe_reads
from titan_moe.train.platform import resolve_device_type

MODEL_NAME = "titan_moe"
# gloo ranks beyond two per core only oversubscribe the machine.
CPU_PROCESSES_PER_CORE = 2


@dataclass
class Model(tt_config.Model):
    name: str = MODEL_NAME
    """Train spec to run: "titan_moe", or any torchtitan-registered spec."""
    flavor: str = "debug"
    """Model flavor: debug | proxy | full for titan_moe."""
    hf_assets_path: str = str(ASSETS_DIR)
    """Folder of tokenizer/model assets; ours ship in the package."""


@dataclass
class Training(tt_config.Training):
    dataset: str = "pystdlib"
    """A local dataset prepared on first use under ./data/<name> (see titan_moe/data)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: CUDA + nccl, CPU + gloo, or auto (CUDA when one is visible)."""
    dataset_text_field: str = "text"
    """The document field of .jsonl / .parquet data."""
    shuffle_windows: int = 0
    """Packed windows held in a seeded shuffle buffer (0: keep the corpus order)."""
    min_doc_tokens: int = 0
    """Skip documents shorter than this many tokens (the long-context stages' data mix)."""
    image_data: str = ""
    """Images for the vision tower: "digits" (scikit-learn's) or a .jsonl file / folder of
    image-text documents (data/images.py); empty: text only."""
    image_docs_per_text_doc: int = 1
    """Image documents interleaved after each text document of the corpus."""
    loss_chunk: int = 0
    """Positions per chunk of the chunked LM-head cross-entropy (titan_moe/train/chunked_loss.py),
    so the [T, vocab] logits never exist whole; 0: the full-logits loss."""
    activation_offload: bool = False
    """Keep what autograd saves outside the checkpointed layers (under full AC: each layer's
    inputs) in pinned host memory, torch.autograd.graph.save_on_cpu (titan_moe/plan models it)."""
    max_consecutive_skipped_steps: int = 3
    """A step whose loss or grad norm is not finite is skipped (no optimizer step, counted as
    train/skipped_steps); this many in a row stop the run (titan_moe/train/step_guard.py)."""
    skip_bad_documents: bool = False
    """Skip and count (data/skipped_documents) documents that cannot be read (invalid JSON, no
    text field, not UTF-8) instead of stopping at the first with its file:line."""


@dataclass
class MultimodalEval:
    freq: int = 0
    """Every this many steps, score held-out digit images answered in text (0: never)."""
    images: int = 50
    """Held-out digit images scored per evaluation (at most the 179 of data/images.py)."""


# --- Scale: sharding choice and float8 training (issue 7) ---------------------------------------


@dataclass
class Parallelism(tt_config.Parallelism):
    sharding: Literal["fsdp2", "simple_fsdp"] = "fsdp2"
    """How data-parallel ranks shard the model: FSDP2 (fully_shard, per block) or torchtitan's
    SimpleFSDP (DTensor parametrization; the compiler places the collectives)."""
    simple_fsdp_passes: Literal["none", "auto_bucketing", "transformer_block_bucketing"] = "none"
    """SimpleFSDP only: Inductor's collective bucketing/reordering pass on the compiled model."""


@dataclass
class Float8:
    enable: bool = False
    """torchao float8 training for the dense nn.Linear layers (CUDA capability >= 8.9)."""
    recipe: Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"] = "rowwise"
    """torchao 0.18 Float8LinearConfig recipe."""
    filter_min_size: int = 1024
    """Linears with in_features or out_features below this stay bf16 (too small to gain)."""
    skip: list[str] = field(default_factory=lambda: ["output"])
    """Module name suffixes that stay bf16 (the LM head by default; the router is no Linear)."""
    moe: bool = False
    """Float8 rowwise grouped GEMMs for the routed experts (torchao MoE training, sm90+)."""
    emulate: bool = False
    """Emulated float8 (tests on CPU): numerics of float8 without float8 hardware."""


def _check_reliability(training: Training) -> None:
    if training.max_consecutive_skipped_steps < 1:
        raise ConfigError("training.max_consecutive_skipped_steps must be >= 1, got "
                          f"{training.max_consecutive_skipped_steps}")
    if training.skip_bad_documents and training.image_data:
        raise ConfigError("training.skip_bad_documents supports text-only training; set "
                          "training.image_data = '' or skip_bad_documents = false")


# At least these values; torchtitan asserts on, divides by or silently misuses anything less.
_MINIMUMS = {
    ("training", "steps"): 1,
    ("training", "local_batch_size"): 1,
    ("lr_scheduler", "warmup_steps"): 0,
    ("metrics", "log_freq"): 1,
    ("checkpoint", "interval"): 1,
    ("optimizer", "lr"): 0,
}


def _check_numbers(job_config: Any) -> None:
    for (section, key), low in _MINIMUMS.items():
        value = getattr(getattr(job_config, section), key)
        if value < low:
            raise ConfigError(f"{section}.{key} must be >= {low}, got {value}")
    if job_config.training.max_norm <= 0:
        raise ConfigError(f"training.max_norm must be > 0, got {job_config.training.max_norm}")
    ratio = job_config.lr_scheduler.decay_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise ConfigError(f"lr_scheduler.decay_ratio must be None or in [0, 1], got {ratio}")


_DEGREES = ("data_parallel_replicate_degree", "data_parallel_shard_degree",
            "context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree")


def _check_parallel_dims(job_config: Any, world_size: int, source: str) -> None:
    """The rules of torchtitan's ParallelDims._validate and its mesh and batch arithmetic."""
    parallelism, training = job_config.parallelism, job_config.training
    dp_rep, dp_shard, cp, tp, pp = (getattr(parallelism, name) for name in _DEGREES)
    ep, etp = parallelism.expert_parallel_degree, parallelism.expert_tensor_parallel_degree
    for name in (*_DEGREES, "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(parallelism, name)
        if value < 1 and not (name == "data_parallel_shard_degree" and value == -1):
            allowed = "-1 (the rest of the processes) or >= 1" if "shard" in name else ">= 1"
            raise ConfigError(f"parallelism.{name} must be {allowed}, got {value}")
    if dp_shard == -1:
        dp_shard = world_size // (dp_rep * cp * tp * pp)
    if dp_rep * dp_shard * cp * tp * pp != world_size:
        raise ConfigError(
            "parallelism.data_parallel_replicate_degree x data_parallel_shard_degree x "
            "context_parallel_degree x tensor_parallel_degree x pipeline_parallel_degree = "
            f"{dp_rep} x {parallelism.data_parallel_shard_degree} x {cp} x {tp} x {pp} must "
            f"equal the process count {source}={world_size}")
    if ep > 1 and etp not in (1, tp):
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree must be 1 or "
                          f"tensor_parallel_degree = {tp} with expert parallelism, got {etp}")
    if (dp_shard * cp * tp) % (ep * etp):
        raise ConfigError(
            f"parallelism.expert_parallel_degree x expert_tensor_parallel_degree = {ep} x {etp} "
            f"must divide data_parallel_shard_degree x context_parallel_degree x "
            f"tensor_parallel_degree = {dp_shard} x {cp} x {tp}")
    per_step = training.local_batch_size * dp_rep * dp_shard
    batch = training.global_batch_size
    if batch == 0 or (batch > 0 and batch % per_step):
        raise ConfigError(
            f"training.global_batch_size must be -1 (no accumulation) or a positive multiple of "
            f"training.local_batch_size x the data-parallel degree = {per_step}, got {batch}")


def _check_loss_chunk(job_config: Any) -> None:
    chunk = job_config.training.loss_chunk
    if chunk < 0:
        raise ConfigError(f"training.loss_chunk must be >= 0 (0: full logits), got {chunk}")
    if chunk and job_config.parallelism.sharding == "simple_fsdp":
        raise ConfigError("training.loss_chunk > 0 supports parallelism.sharding = 'fsdp2' only; "
                          "set loss_chunk = 0 with simple_fsdp")


def _check_activation_offload(job_config: Any) -> None:
    # Without full AC every layer's intermediates would cross PCIe twice a step.
    if job_config.training.activation_offload and job_config.activation_checkpoint.mode != "full":
        raise ConfigError("training.activation_offload = true needs activation_checkpoint.mode = "
                          f"'full', got {job_config.activation_checkpoint.mode!r}")


def _check_context_parallel(job_config: Any, vision: str, seq_segment: int) -> None:
    """CP shards each sequence into cp contiguous slabs (titan_moe/parallel/context_parallel.py).
    It replaces the KDA mixers' sequence steps with ones that exchange the conv halo and the state
    across ranks, which KDA segments (titan_moe.seq_segment) do not call."""
    parallelism, training = job_config.parallelism, job_config.training
    cp = parallelism.context_parallel_degree
    if cp <= 1:
        return
    slab = cp * KDA_CHUNK_SIZE
    if training.seq_len % slab:
        raise ConfigError(
            f"training.seq_len = {training.seq_len} must be a multiple of "
            f"parallelism.context_parallel_degree x the KDA chunk = {cp} x {KDA_CHUNK_SIZE} "
            f"= {slab}, so every rank holds whole chunks")
    unsupported = {
        "parallelism.pipeline_parallel_degree > 1": parallelism.pipeline_parallel_degree > 1,
        "parallelism.tensor_parallel_degree > 1": parallelism.tensor_parallel_degree > 1,
        "parallelism.expert_parallel_degree > 1": parallelism.expert_parallel_degree > 1,
        "parallelism.sharding = 'simple_fsdp'": parallelism.sharding == "simple_fsdp",
        "titan_moe.vision (image batches)": vision != "none",
        "titan_moe.seq_segment > 0 (KDA segments)": seq_segment > 0,
        "validation.enable": job_config.validation.enable,
    }
    for name, on in unsupported.items():
        if on:
            raise ConfigError(
                f"parallelism.context_parallel_degree = {cp} does not support {name}; "
                "context parallelism runs text batches with sharding = 'fsdp2'")


def _check_pipeline_parallel(job_config: Any, n_layers: int) -> None:
    """PP runs StageModules (titan_moe/parallel/pipeline.py) on the looped schedules tested
    against one process (parallel/pipeline_schedule.py). Image batches train (the vision tower
    sits on the first stage); the multimodal eval does not, it runs the whole model on one rank,
    which a pipeline rank does not hold. `training.loss_chunk` > 0 trains: the last stage
    returns its normed hidden states and its loss applies the head's weight by chunks.
    `training.activation_offload` trains: the whole schedule step runs under save_on_cpu.
    `validation.enable` runs each validation batch through the schedule's forward-only `eval`
    (train/validator.py), split into the training step's micro-batches: its local batch size and
    sequence length must be the training ones: the stages' receive buffers have the shapes torch
    inferred from a training batch."""
    parallelism, training = job_config.parallelism, job_config.training
    pp = parallelism.pipeline_parallel_degree
    if pp <= 1:
        return
    unsupported = {
        "parallelism.context_parallel_degree > 1": parallelism.context_parallel_degree > 1,
        "parallelism.sharding = 'simple_fsdp'": parallelism.sharding == "simple_fsdp",
        "multimodal_eval.freq > 0": job_config.multimodal_eval.freq > 0,
        "eval.long_context": job_config.eval.long_context,
        "parallelism.pipeline_parallel_schedule_csv": bool(
            parallelism.pipeline_parallel_schedule_csv),
        "parallelism.module_fqns_per_model_part (stages are cut on AttnRes blocks)":
            parallelism.module_fqns_per_model_part is not None,
    }
    for name, on in unsupported.items():
        if on:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree = {pp} does not support {name}; pipeline "
                "parallelism runs with sharding = 'fsdp2'")
    validation = job_config.validation
    if validation.enable and (validation.local_batch_size, validation.seq_len) != (
            training.local_batch_size, training.seq_len):
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree = {pp} validates through the training "
            f"schedule: validation.local_batch_size = {validation.local_batch_size} and "
            f"validation.seq_len = {validation.seq_len} must equal training.local_batch_size = "
            f"{training.local_batch_size} and training.seq_len = {training.seq_len}")
    schedule = parallelism.pipeline_parallel_schedule
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {schedule!r} is not "
                          f"supported by titan_moe; allowed: {', '.join(PIPELINE_SCHEDULES)}")
    microbatch = parallelism.pipeline_parallel_microbatch_size
    if microbatch < 1 or training.local_batch_size % microbatch:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size = {microbatch} must be >= 1 and "
            f"divide training.local_batch_size = {training.local_batch_size}")
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is not None and layers_per_stage < 1:
        raise ConfigError("parallelism.pipeline_parallel_layers_per_stage must be >= 1 (or unset), "
                          f"got {layers_per_stage}")
    per_rank = stages_per_rank(schedule, pp, n_layers, layers_per_stage)
    single = single_stage_schedule(schedule)
    if layers_per_stage is not None:
        total = math.ceil(n_layers / layers_per_stage)
        if total != pp * per_rank or per_rank < (1 if single else 2):
            need = f"= {pp}" if single else f"a multiple of {pp}, >= 2 per rank"
            raise ConfigError(
                f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} gives "
                f"{total} stages of titan_moe.n_layers = {n_layers}; {schedule} with "
                f"pipeline_parallel_degree = {pp} needs {need}")
    if pp * per_rank > n_layers:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree = {pp} x {per_rank} stages per rank "
            f"({schedule}) exceeds titan_moe.n_layers = {n_layers}: every stage needs a layer")


def _check_scale(job_config: Any, device_type: str) -> None:
    if job_config.float8.enable or job_config.float8.moe:
        # Imported only when asked for: torchao's import prints warnings into the one-line errors.
        from float8 import check_float8_hardware

        check_float8_hardware(job_config.float8, device_type)
    parallelism = job_config.parallelism
    if parallelism.sharding == "simple_fsdp" and parallelism.expert_parallel_degree > 1:
        raise ConfigError(
            "parallelism.sharding = 'simple_fsdp' supports expert_parallel_degree = 1 only; "
            "use sharding = 'fsdp2' with expert parallelism"
        )
    if parallelism.simple_fsdp_passes != "none" and parallelism.sharding != "simple_fsdp":
        raise ConfigError(
            "parallelism.simple_fsdp_passes needs parallelism.sharding = 'simple_fsdp'"
        )


# --- Compile: our Inductor passes (issue 6) -------------------------------------------------------


@dataclass
class Compile(tt_job_config.Compile):
    passes: list[str] = field(default_factory=lambda: list(PASS_NAMES))
    """Our Inductor passes (compile_passes/registry.py), installed on every compiled layer:
    situ_glu, attn_res, kda_gate; [] (CLI: --compile.passes "") compiles without them."""
    fullgraph: bool = True
    """torch.compile(fullgraph=...) of each compiled piece: True turns a graph break into an
    error."""
    inductor: list[str] = field(default_factory=list)
    """Inductor options for every compiled piece, each KEY=VALUE with KEY an option of
    torch._inductor.config and VALUE JSON of its type, e.g. ["combo_kernels=true"] (CLI:
    --compile.inductor combo_kernels=true,cpp_wrapper=true). Checked before anything compiles."""
    cudagraphs: bool = False
    """CUDA only: replay each compiled piece as CUDA graphs (Inductor's cudagraph trees), so the
    host's launches stop setting the step's pace (parallel/parallelize.py's apply_compile). fla's
    KDA kernels then take the documents in fixed shapes: at most one document start per 64
    tokens of a row on average (a batch past that is refused with its count)."""


def _check_compile(job_config: Any) -> None:
    config = job_config.compile
    config.passes = [name for name in config.passes if name]  # CLI "" is the empty list
    try:
        check_pass_names(config.passes, "compile.passes")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    config.inductor = [text for text in config.inductor if text]
    try:
        inductor_settings(config.inductor, "compile.inductor")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.enable and config.inductor:
        if config.backend != "inductor":
            raise ConfigError(f"compile.inductor {config.inductor} are Inductor options but "
                              f"compile.backend is {config.backend!r}; allowed with them: "
                              "'inductor' (or set compile.inductor = [])")
        if job_config.parallelism.sharding == "simple_fsdp":
            # compile_simple_fsdp compiles the model through torchtitan's backend, not ours.
            raise ConfigError("compile.inductor with parallelism.sharding = 'simple_fsdp' is not "
                              "supported; set compile.inductor = [] or sharding = 'fsdp2'")
    if config.enable and config.passes and config.backend != "inductor":
        raise ConfigError(
            f"compile.passes {config.passes} are Inductor passes but compile.backend is "
            f"{config.backend!r}; allowed with passes: 'inductor' (or set compile.passes = [])"
        )
    if config.enable and config.cudagraphs:
        if config.backend != "inductor":
            raise ConfigError(f"compile.cudagraphs needs compile.backend = 'inductor', got "
                              f"{config.backend!r} (or set compile.cudagraphs = false)")
        if job_config.parallelism.context_parallel_degree > 1:
            raise ConfigError("compile.cudagraphs with parallelism.context_parallel_degree > 1 "
                              "is not supported (the KDA state exchange runs eagerly); set "
                              "compile.cudagraphs = false")
        if _model_field(job_config, _flavor_args(job_config), "seq_segment", 0):
            # Each later MLA segment attends a longer key prefix than its queries, off the
            # static-layout attention that CUDA graphs need; and the segments are checkpoints.
            raise ConfigError("compile.cudagraphs with titan_moe.seq_segment > 0 is not "
                              "supported; allowed: seq_segment = 0 (or set compile.cudagraphs = "
                              "false)")
        if job_config.activation_checkpoint.mode != "none":
            # Recomputation would replay forward graphs inside the backward: untested.
            raise ConfigError("compile.cudagraphs with activation_checkpoint.mode = "
                              f"{job_config.activation_checkpoint.mode!r} is not supported; "
                              "allowed: 'none' (or set compile.cudagraphs = false)")


# -------------------------------------------------------------------------------------------------


@dataclass
class Eval:
    """[eval]: the long-context evaluation at the last step (titan_moe/eval/long_context.py)."""

    long_context: bool = False
    """Log loss by position bucket and the needle probe to TensorBoard at the last step."""
    needle_lengths: list[int] = field(default_factory=list)
    """Context lengths of the needle probe (empty: seq_len / 4, seq_len / 2, seq_len)."""
    needle_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    """Where the needle sits, as a fraction of the context, each in [0, 1]."""
    needle_trials: int = 2
    """Needles per (length, depth)."""


def needle_lengths(eval_config: Eval, seq_len: int) -> list[int]:
    return eval_config.needle_lengths or [seq_len // 4, seq_len // 2, seq_len]


def _check_eval(job_config: Any) -> None:
    config, seq_len = job_config.eval, job_config.training.seq_len
    if not config.long_context:
        return
    for length in needle_lengths(config, seq_len):
        if not 64 <= length <= seq_len:
            raise ConfigError(f"eval.needle_lengths: {length} must lie in [64, training.seq_len "
                              f"= {seq_len}]")
    if not config.needle_depths or not all(0 <= d <= 1 for d in config.needle_depths):
        raise ConfigError(f"eval.needle_depths must be non-empty fractions in [0, 1], got "
                          f"{config.needle_depths}")
    if config.needle_trials < 1:
        raise ConfigError(f"eval.needle_trials must be >= 1, got {config.needle_trials}")


def model_args_class(model_name: str) -> type:
    """The model-args dataclass of a train spec."""
    if model_name == MODEL_NAME:
        return TitanMoEArgs
    return type(next(iter(_train_spec(model_name).model_args.values())))


def model_flavors(model_name: str) -> dict[str, Any]:
    """The flavor name -> model args mapping of a train spec."""
    if model_name == MODEL_NAME:
        return FLAVORS
    return dict(_train_spec(model_name).model_args)


def _train_spec(model_name: str):
    try:
        return get_train_spec(model_name)
    except ValueError as e:
        raise ConfigError(f"model.name {model_name!r} is not a registered train spec") from e


def overrides_section(args_cls: type) -> type:
    """A dataclass with one `T | None = None` field for every overridable field of args_cls."""
    hints = typing.get_type_hints(args_cls)
    entries = [
        (f.name, hints[f.name] | None, field(default=None))
        for f in dataclasses.fields(args_cls)
        if f.init and not f.name.startswith("_") and _is_simple(hints[f.name])
    ]
    return make_dataclass("TitanMoEOverrides", entries)


def job_config_class(args_cls: type) -> type:
    """torchtitan's JobConfig with our model defaults, `training.device`, `parallelism.sharding`,
    `compile.passes` / `compile.fullgraph`, `[float8]` and `[titan_moe]`."""
    section = overrides_section(args_cls)
    return make_dataclass(
        "TitanMoEJobConfig",
        [
            ("model", Model, field(default_factory=Model)),
            ("training", Training, field(default_factory=Training)),
            ("parallelism", Parallelism, field(default_factory=Parallelism)),
            ("compile", Compile, field(default_factory=Compile)),
            ("float8", Float8, field(default_factory=Float8)),
            ("eval", Eval, field(default_factory=Eval)),
            (MODEL_NAME, section, field(default_factory=section)),
            ("multimodal_eval", MultimodalEval, field(default_factory=MultimodalEval)),
        ],
        bases=(tt_config.JobConfig,),
    )


def model_overrides(job_config: Any) -> dict[str, Any]:
    """The `[titan_moe]` fields that were set (non-None)."""
    section = getattr(job_config, MODEL_NAME)
    return {k: v for k, v in dataclasses.asdict(section).items() if v is not None}


def job_model_args(job_config: Any) -> TitanMoEArgs:
    """The model args a titan_moe job trains: its flavor, `[titan_moe]` overrides and seq_len."""
    return model_args(job_config.model.flavor,
                      **{"max_seq_len": job_config.training.seq_len, **model_overrides(job_config)})


def parse_job_config(argv: Sequence[str]) -> Any:
    """Validate and parse `--job.config_file F --section.key value ...` into a JobConfig."""
    argv = list(argv)
    toml_values, source = _load_toml(argv)
    custom_import = _lookup(argv, toml_values, "experimental", "custom_import", "")
    if custom_import:
        try:
            importlib.import_module(custom_import)
        except ImportError as e:
            raise ConfigError(
                f"experimental.custom_import: cannot import {custom_import!r}: {e}"
            ) from None
    model_name = _lookup(argv, toml_values, "model", "name", MODEL_NAME)
    if model_name == MODEL_NAME:
        _check_config_modules(argv, toml_values)
    config_cls = job_config_class(model_args_class(model_name))
    _check_toml(config_cls, toml_values, source)
    _check_cli(config_cls, argv)
    job_config = ConfigManager(config_cls).parse_args(argv)
    _check_semantics(job_config)
    return job_config


def parse_job_config_or_exit(argv: Sequence[str]) -> Any:
    """parse_job_config, but a ConfigError becomes one `error:` line on stderr and exit 2."""
    try:
        return parse_job_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _load_toml(argv: list[str]) -> tuple[dict[str, Any], str]:
    path = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if not eq and i + 1 == len(argv):
                raise ConfigError(f"{key} needs a path")
            path = value if eq else argv[i + 1]
    if path is None:
        return {}, "defaults"
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f), path
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _lookup(argv: list[str], toml_values: dict[str, Any], section: str, key: str, default: str):
    """A string option as tyro will see it (CLI over TOML), read before the schema is known."""
    table = toml_values.get(section)
    value = table.get(key, default) if isinstance(table, dict) else default
    names = {f"--{section}.{key}", f"--{section}.{key.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else value)
    return value


def _check_config_modules(argv: list[str], toml_values: dict[str, Any]) -> None:
    """Read before ConfigManager, which would import the module and merge its JobConfig."""
    for section, key in (("job", "custom_config_module"), ("experimental", "custom_args_module")):
        module = _lookup(argv, toml_values, section, key, "")
        if module:
            raise ConfigError(
                f"{section}.{key} = {module!r} is not supported by titan_moe: its JobConfig is "
                "titan_moe/train/config.py's (add sections there); allowed: ''")


def _allowed(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _check_toml(cls: type, values: dict[str, Any], source: str, path: str = "") -> None:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            what = f"key '{where}'" if path else f"section [{key}]"
            scope = f"keys of [{path}]" if path else "sections"
            raise ConfigError(f"unknown {what} in {source}; allowed {scope}: {_allowed(cls)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where} in {source} must be a [{where}] table")
            _check_toml(hint, value, source, where)
        elif not value_matches(hint, value):
            raise ConfigError(
                f"{where}: expected {type_name(hint)}, got {value!r} ({source})"
            )


def _check_cli(cls: type, argv: list[str]) -> None:
    flag = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            continue
        if not arg.startswith("--"):
            advice = f"; --{flag} is a flag: write --{flag} or --{_no(flag)}" if flag else ""
            raise ConfigError(f"unexpected argument {arg!r}{advice}")
        name, eq, inline = arg[2:].partition("=")
        path, hint = _resolve(cls, name.replace("-", "_"))
        if hint is bool or hint is None:
            flag = path  # `--a.b` or `--a.no_b`: takes no value
            continue
        flag = None
        values = [inline] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if not cli_values_match(hint, values):
            got = " ".join(values) if values else "no value"
            raise ConfigError(f"{path}: expected {type_name(hint)}, got {got!r} (--{name})")


def _no(path: str) -> str:
    section, _, key = path.rpartition(".")
    return f"{section}.no_{key}" if section else f"no_{key}"


def _resolve(cls: type, dotted: str) -> tuple[str, Any]:
    """(canonical path, field type) of a CLI key; (path, None) for a `no_` flag of a bool."""
    parts = dotted.split(".")
    node, done = cls, []
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            break
        hints = typing.get_type_hints(node)
        last = depth == len(parts) - 1
        if part not in hints and last and part.startswith("no_") and hints.get(part[3:]) is bool:
            return ".".join([*done, part[3:]]), None
        if part not in hints:
            where = f"keys of [{'.'.join(done)}]" if done else "sections"
            allowed = _allowed(node)
            raise ConfigError(f"unknown key '--{dotted}'; allowed {where}: {allowed}")
        node = hints[part]
        done.append(part)
    if dataclasses.is_dataclass(node) or len(done) != len(parts):
        raise ConfigError(f"'--{dotted}' is not a config key; name a field, e.g. --training.steps")
    return ".".join(done), node


def _check_semantics(job_config: Any) -> None:
    try:
        device_type = resolve_device_type(job_config.training.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n_processes = _check_process_count(device_type)
    _check_numbers(job_config)
    checkpoint = job_config.checkpoint
    if checkpoint.create_seed_checkpoint and (n_processes != 1 or not checkpoint.enable):
        raise ConfigError(
            "checkpoint.create_seed_checkpoint needs NGPU=1 and checkpoint.enable = true"
        )
    _check_profiling(job_config.profiling, device_type)
    _check_scale(job_config, device_type)
    _check_compile(job_config)
    _check_reliability(job_config.training)
    _check_data(job_config)
    _check_eval(job_config)
    _check_loss_chunk(job_config)
    _check_activation_offload(job_config)
    flavor_args = _flavor_args(job_config)
    _check_multimodal(job_config, flavor_args)
    n_layers = _model_field(job_config, flavor_args, "n_layers", 1)
    _check_pipeline_parallel(job_config, n_layers)
    _check_context_parallel(job_config, _vision(job_config, flavor_args),
                            _model_field(job_config, flavor_args, "seq_segment", 0))
    if job_config.model.name == MODEL_NAME:
        check_titan_moe_reads(job_config)
    # WORLD_SIZE spans the nodes under torchrun; run_train.sh checks before it, one node of NGPU.
    world_source = "WORLD_SIZE" if "WORLD_SIZE" in os.environ else "NGPU"
    _check_parallel_dims(job_config, int(os.environ.get("WORLD_SIZE", n_processes)), world_source)
    seq_lens = [("training.seq_len", job_config.training.seq_len)]
    if job_config.validation.enable:
        seq_lens.append(("validation.seq_len", job_config.validation.seq_len))
    for name, seq_len in seq_lens:
        if seq_len <= 0 or seq_len % KDA_CHUNK_SIZE:
            raise ConfigError(
                f"{name} must be a positive multiple of the KDA chunk ({KDA_CHUNK_SIZE}), "
                f"got {seq_len}"
            )
    try:
        flavor_args.update_from_config(job_config)
    except ValueError as e:
        raise ConfigError(str(e).replace("\n", " ")) from None
    ep = job_config.parallelism.expert_parallel_degree
    n_experts = getattr(flavor_args, "n_experts", 1)  # another train spec may have no experts
    if n_experts % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} must divide n_experts = {n_experts}")


def _check_data(job_config: Any) -> None:
    sections = ["training"] + (["validation"] if job_config.validation.enable else [])
    for section in sections:
        config = getattr(job_config, section)
        try:
            check_data_source(config.dataset, config.dataset_path, section)
        except OSError as e:
            raise ConfigError(str(e)) from None


def _model_field(job_config: Any, flavor_args: Any, name: str, default: Any) -> Any:
    """A model field as the job sets it: its `[titan_moe]` override, else the flavor's."""
    return model_overrides(job_config).get(name, getattr(flavor_args, name, default))


def _vision(job_config: Any, flavor_args: Any) -> str:
    return _model_field(job_config, flavor_args, "vision", "none")


def _check_multimodal(job_config: Any, flavor_args: Any) -> None:
    training, evaluation = job_config.training, job_config.multimodal_eval
    vision = _vision(job_config, flavor_args)
    wants_images = training.image_data or evaluation.freq > 0
    if wants_images and vision == "none":
        raise ConfigError("training.image_data / multimodal_eval.freq need a vision tower: set "
                          "titan_moe.vision to debug, proxy or full")
    if training.image_data and training.image_data != "digits" and not Path(
            training.image_data).exists():
        raise ConfigError(f"training.image_data={training.image_data!r}: not 'digits' and no "
                          "such .jsonl file or folder")
    if training.image_docs_per_text_doc < 1:
        raise ConfigError("training.image_docs_per_text_doc must be >= 1, got "
                          f"{training.image_docs_per_text_doc}")
    if evaluation.freq < 0 or evaluation.images < 1:
        raise ConfigError(f"multimodal_eval.freq must be >= 0 and multimodal_eval.images >= 1, "
                          f"got {evaluation.freq} and {evaluation.images}")
    if evaluation.images > DIGITS_HELD_OUT:  # more would silently score only the 179
        raise ConfigError(f"multimodal_eval.images = {evaluation.images}: there are only "
                          f"{DIGITS_HELD_OUT} held-out digit images")


def _check_profiling(profiling: tt_config.Profiling, device_type: str) -> None:
    window = profiling.profiler_warmup + profiling.profiler_active
    if profiling.enable_profiling and profiling.profile_freq < window:
        raise ConfigError(
            f"profiling.profile_freq must be >= profiler_warmup + profiler_active = {window}, "
            f"got {profiling.profile_freq}"
        )
    if profiling.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot records the CUDA allocator and needs CUDA; "
            "on CPU use profiling.enable_profiling"
        )


def _flavor_args(job_config: Any) -> Any:
    """A copy of the flavor's model args, so checking the overrides changes nothing."""
    flavors = model_flavors(job_config.model.name)
    flavor = job_config.model.flavor
    if flavor not in flavors:
        raise ConfigError(f"model.flavor {flavor!r} is unknown; allowed: {', '.join(flavors)}")
    return copy.deepcopy(flavors[flavor])


def _check_process_count(device_type: str) -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("NGPU", "1"))
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(f"NGPU must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ConfigError(f"NGPU must be a positive integer, got {n}")
    if device_type == "cuda":
        if n > torch.cuda.device_count():
            raise ConfigError(
                f"NGPU={n} processes but only {torch.cuda.device_count()} CUDA device(s) visible"
            )
    else:
        cap = CPU_PROCESSES_PER_CORE * (os.cpu_count() or 1)
        if n > cap:
            raise ConfigError(
                f"NGPU={n} processes on CPU exceeds the cap of {cap} "
                f"({CPU_PROCESSES_PER_CORE} per core x {os.cpu_count()} cores)"
            )
    return n


_SCALARS = (bool, int, float, str)


def _is_simple(hint: Any) -> bool:
    """Types this module can check and tyro parses from one CLI key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS or origin is Literal:
        return True
    if origin in (types.UnionType, typing.Union):
        return all(a is type(None) or _is_simple(a) for a in args)
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return len(inner) == 1 and inner[0] in _SCALARS
    return False


if __name__ == "__main__":
    parse_job_config_or_exit(sys.argv[1:])
