"""Config parsing: the [titan_moe] override section and one clear error per bad input."""

import dataclasses
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

from titan_moe.model.args import TitanMoEArgs
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK
from titan_moe.train.config import (
    ConfigError,
    model_overrides,
    parse_job_config,
    parse_job_config_or_exit,
)
from titan_moe.train.trainer import check_graph_sequences, main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NGPU", "1")


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_job_config(argv)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_overrides_section_has_every_model_arg_field():
    config = parse_job_config([])
    expected = {f.name for f in dataclasses.fields(TitanMoEArgs) if not f.name.startswith("_")}
    assert {f.name for f in dataclasses.fields(config.titan_moe)} == expected
    assert model_overrides(config) == {}
    assert (config.model.name, config.model.flavor) == ("titan_moe", "debug")


def test_cli_override_beats_toml_override(tmp_path):
    toml = write_toml(tmp_path, "[titan_moe]\nn_layers = 10\nkda_g_min = -4.0\n")
    config = parse_job_config(["--job.config_file", toml, "--titan_moe.n_layers", "12"])
    assert model_overrides(config) == {"n_layers": 12, "kda_g_min": -4.0}
    tuple_override = parse_job_config(["--titan_moe.mla_layers", "2", "4"])
    assert tuple(model_overrides(tuple_override)["mla_layers"]) == (2, 4)


def test_bool_flags_parse():
    config = parse_job_config(["--metrics.enable_tensorboard", "--training.no-gc-debug"])
    assert config.metrics.enable_tensorboard is True and config.training.gc_debug is False


def test_value_after_a_flag_is_rejected():
    message = error_of(["--checkpoint.last_save_model_only", "false"])
    assert message == (
        "unexpected argument 'false'; --checkpoint.last_save_model_only is a flag: "
        "write --checkpoint.last_save_model_only or --checkpoint.no_last_save_model_only"
    )


def test_missing_config_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.toml")
    assert error_of(["--job.config_file", missing]) == f"config file not found: {missing}"


def test_unknown_toml_key_lists_allowed_keys(tmp_path):
    message = error_of(["--job.config_file", write_toml(tmp_path, "[training]\nstepz = 3\n")])
    assert "'training.stepz'" in message
    assert "allowed keys of [training]:" in message and "seq_len" in message and "steps" in message


def test_unknown_toml_section_lists_sections(tmp_path):
    message = error_of(["--job.config_file", write_toml(tmp_path, "[trainin]\nsteps = 3\n")])
    assert "[trainin]" in message and "titan_moe" in message and "training" in message


def test_unknown_cli_key_lists_allowed_keys():
    message = error_of(["--titan_moe.n_layer", "4"])
    assert message.startswith("unknown key '--titan_moe.n_layer'; allowed keys of [titan_moe]: ")
    assert "n_layers" in message and "top_k" in message
    assert error_of(["--trainin.steps", "4"]).startswith(
        "unknown key '--trainin.steps'; allowed sections: job, profiling"
    )


def test_wrong_types_name_field_expected_and_got(tmp_path):
    toml = write_toml(tmp_path, '[training]\nsteps = "abc"\n')
    wrong_steps = "training.steps: expected int, got 'abc'"
    assert error_of(["--job.config_file", toml]).startswith(wrong_steps)
    assert error_of(["--training.steps", "abc"]).startswith(wrong_steps)
    assert error_of(["--titan_moe.n_layers", "four"]).startswith(
        "titan_moe.n_layers: expected int or None, got 'four'"
    )
    assert error_of(["--training.dtype", "float64"]).startswith(
        "training.dtype: expected one of 'bfloat16', 'float32', got 'float64'"
    )


def test_seq_len_must_be_a_multiple_of_the_kda_chunk():
    message = error_of(["--training.seq_len", str(KDA_CHUNK + 36)])
    assert message.startswith("training.seq_len must be a positive multiple of the KDA chunk (64)")
    parse_job_config(["--training.seq_len", str(2 * KDA_CHUNK)])


def test_missing_data_path_names_the_field(tmp_path):
    message = error_of(["--training.dataset_path", str(tmp_path / "missing")])
    assert message.startswith("training.dataset_path=") and "does not exist" in message
    message = error_of(["--training.dataset", "c4_test"])
    assert "training.dataset='c4_test' is not a local dataset" in message


def test_empty_dataset_folder_is_one_error_line_before_start(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    with pytest.raises(SystemExit) as info:
        parse_job_config_or_exit(["--training.dataset_path", str(folder)])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: training.dataset_path={str(folder)!r}: no .jsonl/.parquet/.txt files found "
        f"under {folder}"
    ]
    (folder / "a.jsonl").touch()
    assert error_of(["--training.dataset_path", str(folder)]) == (
        f"training.dataset_path={str(folder)!r}: all 1 data files are empty")


@pytest.mark.parametrize("argv, message", [
    (["--training.max_consecutive_skipped_steps", "0"],
     "training.max_consecutive_skipped_steps must be >= 1, got 0"),
    (["--training.skip_bad_documents", "--training.image_data", "digits"],
     "training.skip_bad_documents supports text-only training; set training.image_data = '' or "
     "skip_bad_documents = false"),
])
def test_reliability_fields_are_validated(argv, message):
    assert error_of(argv) == message


def test_activation_offload_needs_full_activation_checkpointing():
    # Without full AC, every layer's intermediates would cross PCIe twice a step.
    assert error_of(["--training.activation_offload"]) == (
        "training.activation_offload = true needs activation_checkpoint.mode = 'full', got "
        "'selective'")
    parse_job_config(["--training.activation_offload", "--activation_checkpoint.mode", "full"])


DEGREE_PRODUCT = ("parallelism.data_parallel_replicate_degree x data_parallel_shard_degree x "
                  "context_parallel_degree x tensor_parallel_degree x pipeline_parallel_degree = ")


@pytest.mark.parametrize("argv, message", [
    (["--training.steps", "0"], "training.steps must be >= 1, got 0"),
    (["--training.steps", "-3"], "training.steps must be >= 1, got -3"),
    (["--training.local_batch_size", "0"], "training.local_batch_size must be >= 1, got 0"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0, got -1"),
    (["--metrics.log_freq", "0"], "metrics.log_freq must be >= 1, got 0"),
    (["--checkpoint.interval", "0"], "checkpoint.interval must be >= 1, got 0"),
    (["--optimizer.lr", "-1"], "optimizer.lr must be >= 0, got -1.0"),
    (["--training.max_norm", "0"], "training.max_norm must be > 0, got 0.0"),
    (["--lr_scheduler.decay_ratio", "2"],
     "lr_scheduler.decay_ratio must be None or in [0, 1], got 2.0"),
    (["--parallelism.data_parallel_shard_degree", "3"],
     DEGREE_PRODUCT + "1 x 3 x 1 x 1 x 1 must equal the process count NGPU=2"),
    (["--parallelism.data_parallel_replicate_degree", "4"],
     DEGREE_PRODUCT + "4 x -1 x 1 x 1 x 1 must equal the process count NGPU=2"),
    (["--parallelism.data_parallel_shard_degree", "0"],
     "parallelism.data_parallel_shard_degree must be -1 (the rest of the processes) or >= 1, "
     "got 0"),
    (["--parallelism.tensor_parallel_degree", "0"],
     "parallelism.tensor_parallel_degree must be >= 1, got 0"),
    (["--training.global_batch_size", "6"],
     "training.global_batch_size must be -1 (no accumulation) or a positive multiple of "
     "training.local_batch_size x the data-parallel degree = 16, got 6"),
])
def test_out_of_range_numbers_and_degrees_are_one_line(monkeypatch, argv, message):
    monkeypatch.setenv("NGPU", "2")
    assert error_of(["--training.device", "cpu", *argv]) == message


NOT_FLOAT8 = "titan_moe's quantized training is [float8] (enable, moe)"


# torchtitan options the titan_moe spec does not read: before this check they were ignored, or
# failed inside torchrun (an assert, a KeyError, an ImportError) after the model was built.
@pytest.mark.parametrize("argv, message", [
    (["--parallelism.tensor_parallel_degree", "2"],
     "parallelism.tensor_parallel_degree = 2 is not supported by titan_moe; allowed: 1 (use "
     "data_parallel_shard_degree, expert_parallel_degree, context_parallel_degree or "
     "pipeline_parallel_degree)"),
    (["--parallelism.expert_tensor_parallel_degree", "2"],
     "parallelism.expert_tensor_parallel_degree = 2 is not supported by titan_moe; allowed: 1 "
     "(use data_parallel_shard_degree, expert_parallel_degree, context_parallel_degree or "
     "pipeline_parallel_degree)"),
    (["--parallelism.enable_async_tensor_parallel"],
     "parallelism.enable_async_tensor_parallel = true needs tensor parallelism, which titan_moe "
     "does not support; allowed: false"),
    (["--model.converters", "quantize.linear.mx"],
     f"model.converters = ['quantize.linear.mx'] is not supported by titan_moe ({NOT_FLOAT8}); "
     "allowed: []"),
    (["--quantize.linear.mx.recipe_name", "mxfp8_emulated"],
     "quantize.linear.mx.recipe_name is set, but [quantize] is read only by torchtitan's "
     f"model.converters, which titan_moe does not support ({NOT_FLOAT8}); leave [quantize] at "
     "its defaults"),
    (["--fault_tolerance.enable"],
     "fault_tolerance.enable = true is not supported by titan_moe (the trainer builds no torchft "
     "manager); allowed: false"),
    (["--memory_estimation.enable"],
     "memory_estimation.enable = true is not read by titan_moe's trainer; allowed: false "
     "(estimate memory with python -m titan_moe.plan)"),
    (["--checkpoint.initial_load_in_hf"],
     "checkpoint.initial_load_in_hf = true is not supported by titan_moe (no HF state-dict "
     "adapter; checkpoints are DCP); allowed: false"),
    (["--checkpoint.last_save_in_hf"],
     "checkpoint.last_save_in_hf = true is not supported by titan_moe (no HF state-dict "
     "adapter; checkpoints are DCP); allowed: false"),
    (["--compile.components", "model,optimizer"],
     "compile.components: 'optimizer' is unknown; allowed: model, loss"),
    (["--activation_checkpoint.selective_ac_option", "every_other"],
     "activation_checkpoint.selective_ac_option = 'every_other': allowed 'op' or a layer "
     "frequency (an integer >= 0; 0 and 1: every layer)"),
    (["--activation_checkpoint.mode", "memory_budget"],
     "activation_checkpoint.mode = 'memory_budget' needs compile.enable = true with 'model' in "
     "compile.components (the budget is the compiler's partitioner's)"),
    (["--training.enable_cpu_offload"],
     "training.enable_cpu_offload = true is not supported by titan_moe (its FSDP has no CPU "
     "offload policy); allowed: false (for activations: training.activation_offload)"),
    (["--optimizer.early_step_in_backward"],
     "optimizer.early_step_in_backward = true is not supported by titan_moe (the step would run "
     "before training.max_norm clips and before a non-finite step is skipped); allowed: false"),
    (["--parallelism.fsdp_reshard_after_forward", "never"],
     "parallelism.fsdp_reshard_after_forward = 'never' is not read with parallelism.sharding = "
     "'fsdp2' (its layers reshard after forward); allowed: 'default', 'always', or sharding = "
     "'simple_fsdp'"),
    (["--parallelism.expert_parallel_comm_backend", "deepep"],
     "parallelism.expert_parallel_comm_backend = 'deepep' is not supported by titan_moe (its EP "
     "has its own all-to-all); allowed: 'standard'"),
    (["--debug.moe_force_load_balance"],
     "debug.moe_force_load_balance = true is not read by titan_moe's MoE (Quantile Balancing "
     "balances the experts); allowed: false"),
    (["--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_first_stage_less_layers", "2"],
     "parallelism.pipeline_parallel_first_stage_less_layers = 2 is not read by titan_moe (its "
     "stages are cut on AttnRes blocks, balanced by cost); allowed: 1 (size stages with "
     "pipeline_parallel_layers_per_stage)"),
    (["--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "0"],
     "parallelism.pipeline_parallel_last_stage_less_layers = 0 is not read by titan_moe (its "
     "stages are cut on AttnRes blocks, balanced by cost); allowed: 1 (size stages with "
     "pipeline_parallel_layers_per_stage)"),
    (["--optimizer.name", "SGD"],
     "optimizer.name = 'SGD' is not supported; allowed: Adam, AdamW"),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "128",
      "--parallelism.context_parallel_load_balancer", "ptrr"],
     "parallelism.context_parallel_load_balancer = 'ptrr' is not read by titan_moe's context "
     "parallelism (contiguous slabs); allowed: 'headtail' (the default, not applied either) or "
     "None"),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "128",
      "--parallelism.context_parallel_rotate_method", "alltoall"],
     "parallelism.context_parallel_rotate_method = 'alltoall' is not read by titan_moe's context "
     "parallelism (its own state exchange); allowed: 'allgather' (the default, not applied "
     "either)"),
    (["--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem"],
     "checkpoint.async_mode = 'async_with_pinned_mem' is not supported: checkpoints are "
     "verified by a manifest written after the save completes; allowed: 'disabled'"),
    (["--comm.mode", "local_tensor"],
     "comm.mode = 'local_tensor' is not supported by titan_moe's training run (torchtitan only "
     "builds the trainer in it); allowed: 'default', 'fake_backend'"),
    (["--job.custom_config_module", "my_project.config"],
     "job.custom_config_module = 'my_project.config' is not supported by titan_moe: its "
     "JobConfig is titan_moe/train/config.py's (add sections there); allowed: ''"),
    (["--experimental.custom_args_module", "my_project.config"],
     "experimental.custom_args_module = 'my_project.config' is not supported by titan_moe: its "
     "JobConfig is titan_moe/train/config.py's (add sections there); allowed: ''"),
])
def test_torchtitan_options_titan_moe_does_not_read_are_one_line(monkeypatch, argv, message):
    monkeypatch.setenv("NGPU", "2")
    assert error_of(["--training.device", "cpu", *argv]) == message


real_find_spec = importlib.util.find_spec


def test_wandb_without_the_package_is_one_line(monkeypatch):
    # torchtitan would import wandb only when it builds the logger, inside torchrun.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name))
    assert error_of(["--metrics.enable_wandb"]) == (
        "metrics.enable_wandb = true needs the wandb package, which is not installed; allowed "
        "here: false (metrics.enable_tensorboard logs)")


def test_supported_values_of_the_audited_options_parse(monkeypatch):
    monkeypatch.setenv("NGPU", "2")
    cpu = ["--training.device", "cpu"]
    assert parse_job_config([*cpu, "--compile.components", "model,loss"]).compile.components == [
        "model", "loss"]
    for option in ("op", "0", "2"):
        parse_job_config([*cpu, "--activation_checkpoint.selective_ac_option", option])
    parse_job_config([*cpu, "--activation_checkpoint.mode", "memory_budget", "--compile.enable"])
    parse_job_config([*cpu, "--parallelism.fsdp_reshard_after_forward", "always"])
    parse_job_config([*cpu, "--parallelism.sharding", "simple_fsdp",
                      "--parallelism.fsdp_reshard_after_forward", "never"])
    parse_job_config([*cpu, "--checkpoint.async_mode", "async"])  # no checkpoints: not read
    parse_job_config([*cpu, "--comm.mode", "fake_backend"])
    parse_job_config([*cpu, "--optimizer.name", "Adam"])
    parse_job_config([*cpu, "--parallelism.context_parallel_degree", "2", "--training.seq_len",
                      "128"])
    # torchtitan reads the stage sizes only when it cuts pipeline stages: with pp = 1 they are
    # ignored there too.
    parse_job_config([*cpu, "--parallelism.pipeline_parallel_first_stage_less_layers", "2"])


def test_degrees_are_checked_against_world_size_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cpu = ["--training.device", "cpu"]
    parse_job_config([*cpu, "--parallelism.data_parallel_shard_degree", "4"])
    assert error_of([*cpu, "--parallelism.data_parallel_shard_degree", "2"]).endswith(
        "1 x 2 x 1 x 1 x 1 must equal the process count WORLD_SIZE=4")
    assert error_of([*cpu, "--parallelism.expert_parallel_degree", "3"]).startswith(
        "parallelism.expert_parallel_degree x expert_tensor_parallel_degree = 3 x 1 must divide")


def test_expert_degree_must_divide_the_experts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert error_of(["--training.device", "cpu", "--parallelism.expert_parallel_degree", "3"]) == (
        "parallelism.expert_parallel_degree = 3 must divide n_experts = 16")


def test_profiler_schedule_must_fit():
    message = error_of(["--profiling.enable_profiling", "--profiling.profile_freq", "2"])
    window = "profiler_warmup + profiler_active = 4"
    assert message == f"profiling.profile_freq must be >= {window}, got 2"


def test_model_arg_validation_surfaces_as_config_error():
    assert "titan_moe.top_k" in error_of(["--titan_moe.top_k", "16"])


def test_more_processes_than_cpu_cap(monkeypatch):
    cap, cpu = 2 * os.cpu_count(), ["--training.device", "cpu"]
    monkeypatch.setenv("NGPU", str(cap))
    parse_job_config(cpu)
    monkeypatch.setenv("NGPU", str(cap + 1))
    assert error_of(cpu).startswith(f"NGPU={cap + 1} processes on CPU exceeds the cap of {cap}")


def test_more_processes_than_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert error_of([]) == "NGPU=2 processes but only 1 CUDA device(s) visible"


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in error_of(["--training.device", "cuda"])


def test_or_exit_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_job_config_or_exit(["--training.stepz", "3"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown key '--training.stepz'")


def test_run_train_sh_errors_are_one_line(tmp_path):
    env = {**os.environ, "CONFIG_FILE": str(tmp_path / "missing.toml")}
    missing = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"error: config file not found: {tmp_path / 'missing.toml'} "
        "(set CONFIG_FILE=configs/<name>.toml)"
    ]
    env["CONFIG_FILE"] = write_toml(tmp_path, "[training]\nsteps = 2\n")
    bad_key = subprocess.run(
        ["./run_train.sh", "--training.seq_len", "100"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert bad_key.returncode == 2
    assert bad_key.stderr.splitlines() == [
        "error: training.seq_len must be a positive multiple of the KDA chunk (64), got 100"
    ], bad_key.stderr
    env["NGPU"] = "2"  # torchtitan's ParallelDims would assert inside torchrun
    bad_degree = subprocess.run(
        ["./run_train.sh", "--training.device", "cpu", "--parallelism.data_parallel_shard_degree",
         "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert bad_degree.returncode == 2
    assert bad_degree.stderr.splitlines() == [
        f"error: {DEGREE_PRODUCT}1 x 3 x 1 x 1 x 1 must equal the process count NGPU=2"
    ], bad_degree.stderr


def test_train_entrypoint_exits_2_on_bad_type(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: no single-process env set-up
    with pytest.raises(SystemExit) as info:
        main(["--training.steps", "many"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: training.steps: expected int, got 'many' (--training.steps)"
    ]


PP2 = ["--training.device", "cpu", "--parallelism.pipeline_parallel_degree", "2"]
PP_UNSUPPORTED = "; pipeline parallelism runs with sharding = 'fsdp2'"


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "128"],
     "parallelism.pipeline_parallel_degree = 2 does not support "
     "parallelism.context_parallel_degree > 1" + PP_UNSUPPORTED),
    (["--parallelism.sharding", "simple_fsdp"],
     "parallelism.pipeline_parallel_degree = 2 does not support "
     "parallelism.sharding = 'simple_fsdp'" + PP_UNSUPPORTED),
    (["--titan_moe.vision", "debug", "--multimodal_eval.freq", "5"],
     "parallelism.pipeline_parallel_degree = 2 does not support multimodal_eval.freq > 0"
     + PP_UNSUPPORTED),
    (["--eval.long_context"],
     "parallelism.pipeline_parallel_degree = 2 does not support eval.long_context"
     + PP_UNSUPPORTED),
    # The schedule splits a validation batch into the training step's micro-batches.
    (["--validation.enable", "--validation.dataset", "pystdlib", "--validation.seq_len", "1024"],
     "parallelism.pipeline_parallel_degree = 2 validates through the training schedule: "
     "validation.local_batch_size = 8 and validation.seq_len = 1024 must equal "
     "training.local_batch_size = 8 and training.seq_len = 2048"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble' is not supported by titan_moe; "
     "allowed: 1F1B, Interleaved1F1B"),
    (["--parallelism.pipeline_parallel_microbatch_size", "3"],
     "parallelism.pipeline_parallel_microbatch_size = 3 must be >= 1 and divide "
     "training.local_batch_size = 8"),
    (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_layers_per_stage", "3"],
     "parallelism.pipeline_parallel_layers_per_stage = 3 gives 3 stages of titan_moe.n_layers = "
     "8; Interleaved1F1B with pipeline_parallel_degree = 2 needs a multiple of 2, >= 2 per rank"),
    (["--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "parallelism.pipeline_parallel_degree = 2 x 2 stages per rank (Interleaved1F1B) exceeds "
     "titan_moe.n_layers = 3: every stage needs a layer"),
])
def test_unsupported_pipeline_combinations_are_one_line_naming_the_fields(monkeypatch, argv,
                                                                           message):
    monkeypatch.setenv("NGPU", "2")
    assert error_of([*PP2, *argv]) == message


def test_supported_pipeline_layouts_parse(monkeypatch):
    monkeypatch.setenv("NGPU", "4")
    parse_job_config([*PP2, "--parallelism.expert_parallel_degree", "2"])
    parse_job_config([*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                      "--parallelism.pipeline_parallel_layers_per_stage", "2"])
    # The last stage's loss is the chunked LM-head cross-entropy.
    assert parse_job_config([*PP2, "--training.loss_chunk", "32"]).training.loss_chunk == 32
    # The schedule step runs under save_on_cpu (trainer.py pipeline_step).
    offload = ["--training.activation_offload", "--activation_checkpoint.mode", "full"]
    assert parse_job_config([*PP2, *offload]).training.activation_offload
    # Validation runs the schedule's forward-only eval (train/validator.py).
    validation = ["--validation.enable", "--validation.dataset", "pystdlib"]
    assert parse_job_config([*PP2, *validation]).validation.enable
    # The vision tower sits on the first stage: image batches train under PP.
    config = parse_job_config([*PP2, "--titan_moe.vision", "debug",
                               "--training.image_data", "digits"])
    assert config.parallelism.pipeline_parallel_degree == 2
    assert config.training.image_data == "digits"


def test_cudagraphs_refuse_a_batch_past_the_static_kda_layout():
    """compile.cudagraphs holds one sequence per row plus one per 64 tokens (2 x 128 tokens: 6);
    counted here by hand from the starts, a seventh is refused with the counts in the message."""
    doc = torch.zeros(2, 128, dtype=torch.int32)
    doc[0, 10:] += 1
    doc[0, 20:] += 1
    doc[1, 5:] += 1
    doc[1, 6:] += 1  # rows 2 + starts 4 = 6
    check_graph_sequences(doc)
    doc[1, 7:] += 1
    with pytest.raises(ValueError, match="the batch has 7 sequences .* holds 6 at most"):
        check_graph_sequences(doc)
