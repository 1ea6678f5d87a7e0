"""training.activation_offload in the trainer: the step runs under save_on_cpu, which packs what
the checkpointed layers keep, and trains exactly as without it (reference: the same run with the
offload off; on CPU the host copies are exact, so the losses agree within rtol 1e-6).

Both runs go through `titan_moe.train.trainer.main` in one child process each, with save_on_cpu
replaced by a subclass that counts what it packs (a silently skipped offload packs nothing).
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

RUN = """
import sys
import torch
from torch.autograd.graph import save_on_cpu

packed = [0]


class Counting(save_on_cpu):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        def counted(tensor):
            packed[0] += 1
            return pack(tensor)

        self.pack_hook = counted


torch.autograd.graph.save_on_cpu = Counting
from titan_moe.train.trainer import main

main(sys.argv[1:])
print("packed", packed[0])
"""


def _run(tmp_path: Path, offload: bool, scalars_of) -> tuple[list[float], int]:
    folder = tmp_path / ("offload" if offload else "plain")
    args = ["--job.config_file", "configs/debug.toml", "--job.dump_folder", str(folder),
            "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
            "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
            "--metrics.log_freq", "1", "--checkpoint.no_enable", "--training.device", "cpu",
            "--activation_checkpoint.mode", "full"]
    args += ["--training.activation_offload"] if offload else []
    result = subprocess.run([sys.executable, "-c", RUN, *args], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    packed = int(result.stdout.split("packed")[-1])
    (run_dir,) = (folder / "tb").iterdir()
    return [value for _, value in scalars_of(run_dir, "loss_metrics/global_avg_loss")], packed


def test_offloaded_step_packs_the_saved_tensors_and_trains_alike(tmp_path, scalars_of):
    plain, plain_packed = _run(tmp_path, False, scalars_of)
    offload, packed = _run(tmp_path, True, scalars_of)
    assert plain_packed == 0 and packed > 0
    assert len(plain) == len(offload) == STEPS
    assert offload == pytest.approx(plain, rel=1e-6, abs=0)
