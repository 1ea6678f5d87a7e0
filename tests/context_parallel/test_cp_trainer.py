"""The trainer with context parallelism, compile and the long-context eval all on, as a context
stage would run them: cp = 2 on 2 gloo processes (torchrun), the debug model cut to 2 layers (KDA
and MLA), 2 steps of 256 tokens at batch 1, Inductor per sublayer, the chunked loss, and the
long-context eval at the last step (needles of 128 and 256 tokens) written to TensorBoard.

What this adds to the equivalence tests next to it (which compare numbers against one process):
the config check lets the combination through, parallelize_titan_moe compiles the CP mixers in
pieces, batch 1 (the gathered MLA latents are then a view the compiled code could not rebuild
from its base; the eager steps return tensors of their own), and the eval after compiled
training steps (eager, on each rank's slab).
"""

import os
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cp2_trains_compiled_and_logs_the_long_context_eval(tmp_path):
    args = [
        "--job.dump_folder", str(tmp_path), "--titan_moe.n_layers", "2",
        "--titan_moe.mla_layers", "2", "--training.seq_len", "256",
        "--training.local_batch_size", "1", "--training.steps", "2",
        "--training.shuffle_windows", "0", "--lr_scheduler.warmup_steps", "1",
        "--metrics.log_freq", "1", "--checkpoint.no_enable", "--training.device", "cpu",
        "--training.loss_chunk", "64", "--parallelism.context_parallel_degree", "2",
        "--compile.enable", "--eval.long_context", "--eval.needle_lengths", "128", "256",
        "--eval.needle_depths", "0.5", "--eval.needle_trials", "1",
        "--metrics.disable_color_printing",
    ]
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "CONFIG_FILE": "configs/debug.toml"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=850)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (run_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"long_context/loss_pos_0_1K", "long_context/needle_logprob/len128_depth0.5",
                "long_context/needle_logprob/len256_depth0.5"}
    assert expected <= tags, sorted(tags)
    assert [s.step for s in events.Scalars("long_context/loss_pos_0_1K")] == [2]
    losses = [s.value for s in events.Scalars("loss_metrics/global_avg_loss")]
    assert len(losses) == 2 and losses[1] < losses[0]
