"""training.activation_offload in the trainer: the step runs under save_on_cpu, which packs what
the checkpointed layers keep, and trains exactly as without it (reference: the same run with the
offload off; on CPU the host copies are exact, so the losses agree within rtol 1e-6).

Both runs go through `titan_moe.train.trainer.main` in one child process each (forked from
tests/faults/trainer_process.py's server, which imported the trainer once), with save_on_cpu
replaced by a subclass that counts what it packs (tests/train/count_offload.py: a silently
skipped offload packs nothing).
"""

import re
from pathlib import Path

import pytest

from tests.faults.trainer_process import train_process

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _run(tmp_path: Path, offload: bool, scalars_of) -> tuple[list[float], int]:
    folder = tmp_path / ("offload" if offload else "plain")
    args = ["--job.config_file", "configs/debug.toml", "--job.dump_folder", str(folder),
            "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
            "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
            # The batches in corpus order: no 2048-window shuffle buffer to fill in step 1.
            "--training.shuffle_windows", "0",
            "--metrics.log_freq", "1", "--checkpoint.no_enable", "--training.device", "cpu",
            "--activation_checkpoint.mode", "full",
            "--experimental.custom_import", "tests.train.count_offload"]
    args += ["--training.activation_offload"] if offload else []
    folder.mkdir(parents=True)
    result = train_process(args, {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
                                  "HOME": str(folder), "PYTHONPATH": str(REPO)},
                           REPO, folder / "train.log")
    assert result.returncode == 0, result.log[-4000:]
    counts = re.findall(r"^packed (\d+)$", result.log, re.M)
    packed = int(counts[-1]) if counts else 0
    (run_dir,) = (folder / "tb").iterdir()
    return [value for _, value in scalars_of(run_dir, "loss_metrics/global_avg_loss")], packed


def test_offloaded_step_packs_the_saved_tensors_and_trains_alike(tmp_path, scalars_of):
    plain, plain_packed = _run(tmp_path, False, scalars_of)
    offload, packed = _run(tmp_path, True, scalars_of)
    assert plain_packed == 0 and packed > 0
    assert len(plain) == len(offload) == STEPS
    assert offload == pytest.approx(plain, rel=1e-6, abs=0)
