"""The titan_moe trainer runs FSDP2 + expert parallelism (ep=2, experts on efsdp=1) with full
activation checkpointing over gloo with 2 CPU processes (a smoke test of the trainer wiring:
meta-device init of the EP DTensors, EP-aware grad clipping, QB over the loss mesh).

Sharded initialisation draws different random weights than one process (DTensor RNG), so the
reference here is weaker than loss equality: the run completes and its loss falls over 3 steps.
Exact 1-vs-N equality from identical weights is tests/distributed/.
"""

from tests.distributed.train_jobs import register, shared_runs

# Launched with the other test modules' trainer runs (tests/distributed/train_jobs.py).
register("fsdp_smoke", 2, [
    "--job.config_file", "configs/debug.toml",
    "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
    "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
    "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
    "--checkpoint.no_enable", "--training.device", "cpu",
    "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full",
])


def test_debug_model_trains_with_fsdp_and_expert_parallel_on_two_processes(tmp_path_factory,
                                                                             scalars_of):
    dump, log = shared_runs(tmp_path_factory)["fsdp_smoke"]
    assert "dp_shard=2" in log and "ep=2" in log
    (run_dir,) = (dump / "tb").iterdir()
    losses = [value for _, value in scalars_of(run_dir, "loss_metrics/global_avg_loss")]
    assert len(losses) == 3 and losses[2] < losses[0], losses
