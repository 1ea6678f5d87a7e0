"""Checkpoint resume: 6 straight steps equal 3 steps + save + resume + 3 steps, loss for loss.

Reference: the uninterrupted run. The checkpoint carries model (QB biases included), optimizer,
LR schedule and dataloader position, so on one CPU process the resumed losses are identical
(tolerance 0). A save that was cut short (no DCP `.metadata`) must never be loaded.

The 3-step job stands for a 6-step job interrupted after step 3, so their LR schedules must agree
on steps 1-6: warmup then constant (decay_ratio 0), since a decay phase would end at step 3 in a
3-step job.
"""

import shutil
from pathlib import Path

from tests.faults.trainer_process import train_process

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--job.config_file", "configs/debug.toml",
    "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
    "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.0",
    # A shuffle buffer of 8 windows, not debug.toml's 2048: the checkpoint still carries one
    # (resumed shuffling, tests/data/test_dataloader.py), and step 1 no longer tokenizes 2048
    # windows to fill it first.
    "--training.shuffle_windows", "8",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing", "--training.device", "cpu",
    "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only",
]


def train(dump: Path, steps: int) -> str:
    """The log of a run of `python -m titan_moe.train`'s main, in a process forked from
    trainer_process.py's server (the trainer imported once, not per run)."""
    dump.mkdir(parents=True, exist_ok=True)
    log = dump / f"run-{len(list(dump.glob('run-*.log')))}.log"
    result = train_process([*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump)],
                           {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin", "HOME": str(dump),
                            "PYTHONPATH": str(REPO)}, REPO, log)
    assert result.returncode == 0, result.log[-4000:]
    return result.log


def losses(dump: Path, scalars_of) -> dict[int, float]:
    """Per-step loss from every TensorBoard run under dump (a resumed job writes a new run)."""
    out: dict[int, float] = {}
    for run_dir in sorted((dump / "tb").iterdir()):
        out.update(scalars_of(run_dir, "loss_metrics/global_avg_loss"))
    return out


def test_resume_reproduces_the_uninterrupted_run(tmp_path, scalars_of):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, 6)
    train(resumed, 3)
    step3 = resumed / "checkpoint" / "step-3"
    assert (step3 / ".metadata").is_file()
    # A save interrupted at step 5: its shards were written, its metadata never was.
    partial = resumed / "checkpoint" / "step-5"
    shutil.copytree(step3, partial)
    (partial / ".metadata").unlink()
    log = train(resumed, 6)
    loaded = [line for line in log.splitlines() if "Loading the checkpoint from" in line]
    assert len(loaded) == 1 and loaded[0].rstrip(".").endswith("step-3"), loaded
    want, got = losses(straight, scalars_of), losses(resumed, scalars_of)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
