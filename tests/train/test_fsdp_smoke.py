"""The titan_moe trainer runs FSDP2 + expert parallelism (ep=2, experts on efsdp=1) with full
activation checkpointing over gloo with 2 CPU processes (a smoke test of the trainer wiring:
meta-device init of the EP DTensors, EP-aware grad clipping, QB over the loss mesh).

Sharded initialisation draws different random weights than one process (DTensor RNG), so the
reference here is weaker than loss equality: the run completes and its loss falls over 3 steps.
Exact 1-vs-N equality from identical weights is tests/distributed/.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_debug_model_trains_with_fsdp_and_expert_parallel_on_two_processes(tmp_path, scalars_of):
    args = [
        "--job.config_file", "configs/debug.toml", "--job.dump_folder", str(tmp_path),
        "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
        "--checkpoint.no_enable", "--training.device", "cpu",
        "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "titan_moe.train", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "dp_shard=2" in log and "ep=2" in log
    (run_dir,) = (tmp_path / "tb").iterdir()
    losses = [value for _, value in scalars_of(run_dir, "loss_metrics/global_avg_loss")]
    assert len(losses) == 3 and losses[2] < losses[0], losses
