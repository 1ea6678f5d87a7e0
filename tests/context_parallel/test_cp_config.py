"""Context parallelism and the chunked loss from the TOML: every unsupported combination is one
clear error naming the fields; a supported one (the chunked loss, compile, the long-context
eval) parses."""

import pytest

from titan_moe.train.config import ConfigError, parse_job_config

CP2 = ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "256",
       "--training.device", "cpu"]


@pytest.fixture(autouse=True)
def two_processes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("NGPU", "2")


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_job_config(argv)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_cp_with_chunked_loss_parses():
    config = parse_job_config([*CP2, "--training.loss_chunk", "64"])
    assert config.parallelism.context_parallel_degree == 2 and config.training.loss_chunk == 64


def test_cp_with_compile_and_the_long_context_eval_parses():
    config = parse_job_config([*CP2, "--compile.enable", "--eval.long_context"])
    assert config.parallelism.context_parallel_degree == 2
    assert config.compile.enable and config.eval.long_context


def test_seq_len_must_split_into_whole_kda_chunks():
    message = error_of([*CP2, "--training.seq_len", "192"])
    assert message.startswith("training.seq_len = 192 must be a multiple of "
                              "parallelism.context_parallel_degree x the KDA chunk = 2 x 64")


@pytest.mark.parametrize("extra,field", [
    (["--parallelism.expert_parallel_degree", "2"], "parallelism.expert_parallel_degree"),
    (["--parallelism.sharding", "simple_fsdp"], "parallelism.sharding = 'simple_fsdp'"),
    (["--titan_moe.vision", "debug"], "titan_moe.vision"),
    (["--titan_moe.seq_segment", "64"], "titan_moe.seq_segment"),
])
def test_unsupported_combinations_name_their_fields(extra, field):
    message = error_of([*CP2, *extra])
    assert message.startswith("parallelism.context_parallel_degree = 2 does not support")
    assert field in message


def test_loss_chunk_is_validated():
    assert "training.loss_chunk must be >= 0" in error_of(["--training.loss_chunk", "-1"])
    assert "training.loss_chunk > 0 supports parallelism.sharding = 'fsdp2' only" in error_of(
        ["--training.loss_chunk", "64", "--parallelism.sharding", "simple_fsdp"])
