"""Verified checkpoints (titan_moe/train/checkpoint_verify.py) on the resume tests' tiny CPU run.

One 2-step run saves step-1 and step-2 with their manifests; each test damages a copy of them and
resumes it. A resume asks for `training.steps 1`, so it loads and stops without a training step,
whichever step it loads. The runs go through `titan_moe.train.trainer.main` in this process:
the imports and the first step's warm-up are paid once for the file, not once per run, and
torchtitan's 2 s sleep for other ranks at the end of a run is skipped (one rank: none to wait
for; tests/faults/trainer_process.py's NoSleep).
"""

import dataclasses
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torchtitan.train

from tests.faults.trainer_process import NoSleep
from tests.train.test_checkpoint_resume import REPO, TINY
from titan_moe.train.checkpoint_verify import (
    MANIFEST,
    CheckpointError,
    ModelArgsMismatch,
    verify_checkpoint,
    write_manifest,
)
from titan_moe.train.trainer import main

SHARD = "__0_0.distcp"


def train(dump: Path, steps: int, *extra: str) -> None:
    """One single-process run of the tiny config, saving every step, with a fresh port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        patch.setattr(torchtitan.train, "time", NoSleep())
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            main([*TINY, "--checkpoint.interval", "1", "--training.steps", str(steps),
                  "--job.dump_folder", str(dump), *extra])
        finally:
            # A failed run leaves its process group; the next run in this process needs a new one.
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The checkpoint folder of a 2-step run: step-1 and step-2, each with a manifest."""
    dump = tmp_path_factory.mktemp("saved")
    train(dump, 2)
    return dump / "checkpoint"


@pytest.fixture
def checkpoints(saved, tmp_path) -> Path:
    """A copy of the saved checkpoints, to damage, inside a dump folder of its own."""
    shutil.copytree(saved, tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def resume(checkpoints: Path, capsys, *extra: str) -> tuple[str, list[str]]:
    """Resume from checkpoints' dump folder: the step folder it loaded and the skip messages.
    (torchtitan's init_logger replaces the root logger's handlers (caplog's too) with one
    writing to sys.stdout, so the log is read from there.)"""
    capsys.readouterr()
    train(checkpoints.parent, 1, *extra)
    log = capsys.readouterr().out.splitlines()
    loaded = [line for line in log if "Loading the checkpoint from" in line]
    assert len(loaded) == 1, loaded
    skips = [line.split(" - WARNING - ", 1)[1] for line in log if " - WARNING - Skipping" in line]
    return Path(loaded[0].rstrip(".").split()[-1]).name, skips


def test_a_save_writes_a_manifest_of_every_file(saved):
    for step in ("step-1", "step-2"):
        names = {p.name for p in (saved / step).iterdir()}
        assert names == {".metadata", SHARD, MANIFEST}, names
        assert f'"{SHARD}"' in (saved / step / MANIFEST).read_text()


def test_a_flipped_byte_names_the_shard_and_resume_falls_back(checkpoints, capsys):
    shard = checkpoints / "step-2" / SHARD
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    size = shard.stat().st_size  # less than a chunk: one chunk
    damaged = (f"{shard} is damaged: its sha256 differs from the manifest's in chunk 0 of 1, "
               f"bytes [0, {size}) of {size}")
    with pytest.raises(CheckpointError, match=re.escape(damaged)):
        train(checkpoints.parent, 2, "--checkpoint.load_step", "2")
    assert resume(checkpoints, capsys) == ("step-1", [f"Skipping checkpoint step-2: {damaged}"])


def test_a_truncated_newest_shard_falls_back(checkpoints, capsys):
    shard = checkpoints / "step-2" / SHARD
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    assert resume(checkpoints, capsys) == ("step-1", [
        f"Skipping checkpoint step-2: {shard} has {size // 2} bytes, the manifest {size} "
        "(truncated or overwritten)"])


def test_a_checkpoint_without_manifest_is_skipped(checkpoints, capsys):
    (checkpoints / "step-2" / MANIFEST).unlink()
    assert resume(checkpoints, capsys) == ("step-1", [
        f"Skipping checkpoint step-2: {checkpoints / 'step-2'} has no {MANIFEST}: its save was cut "
        "short, or it predates manifests"])


def test_other_model_args_are_one_error_naming_the_field(checkpoints, capsys):
    with pytest.raises(ModelArgsMismatch) as error:
        resume(checkpoints, capsys, "--titan_moe.n_layers", "4")
    assert str(error.value) == (
        f"checkpoint {checkpoints / 'step-2'} was saved for other model args: n_layers: checkpoint "
        "3 vs config 4; train with the checkpoint's model config, or start a fresh "
        "checkpoint.folder")


def test_a_temporary_manifest_left_by_a_killed_save_is_not_listed(tmp_path):
    """A save killed between writing its manifest's temporary file and renaming it leaves that
    file in the step folder; saving the step again must not list it (the write renames it away),
    or the new manifest names a missing file and the step never verifies
    (tests/faults/test_faults.py kills a real save there)."""

    @dataclasses.dataclass
    class Args:
        dim: int = 8

    (tmp_path / SHARD).write_bytes(b"shard bytes")
    (tmp_path / f".{MANIFEST}.partial").write_text('{"format": 1}')
    write_manifest(tmp_path, Args())
    assert {p.name for p in tmp_path.iterdir()} == {SHARD, MANIFEST}
    verify_checkpoint(tmp_path, Args())


def test_implementation_args_are_not_compared(tmp_path):
    """A checkpoint saved before router_gemm existed, or with another KDA backend, router GEMM or
    sequence length, verifies: none of them shapes a weight. A field that does still raises."""

    @dataclasses.dataclass
    class Args:
        dim: int = 8
        max_seq_len: int = 64
        kda_backend: str = "auto"

    @dataclasses.dataclass
    class Later(Args):
        router_gemm: str = "split_bf16"

    (tmp_path / SHARD).write_bytes(b"shard bytes")
    write_manifest(tmp_path, Args())
    verify_checkpoint(tmp_path, Later(max_seq_len=128, kda_backend="fla", router_gemm="fp32"))
    with pytest.raises(ModelArgsMismatch, match="dim: checkpoint 8 vs config 16"):
        verify_checkpoint(tmp_path, Later(dim=16))
