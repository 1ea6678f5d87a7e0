"""The context-stage chain on CPU: the debug flavor at 256 -> 512 -> 1024 -> 2048 tokens.

Each stage must start from the previous stage's final checkpoint (model with its QB biases;
fresh optimizer and LR warm-up) through scripts/run_stages.sh, exactly as the proxy chain in
configs/stages/ does at 8K -> 64K -> 256K -> 1M.
"""

import os
import subprocess
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (256, 512, 1024, 2048)
STEPS = 2
LR = 1e-3


def stage_toml(folder: Path, seq_len: int, previous: int | None) -> str:
    load = ""
    if previous is not None:
        checkpoint = folder / f"s{previous}" / "checkpoint" / f"step-{STEPS}"
        load = f'initial_load_path = "{checkpoint}"\ninitial_load_model_only = true\n'
    return f"""
[job]
dump_folder = "{folder / f"s{seq_len}"}"
[model]
flavor = "debug"
[titan_moe]
n_layers = 3
mla_layers = [3]
[optimizer]
lr = {LR}
[lr_scheduler]
warmup_steps = 2
[training]
device = "cpu"
local_batch_size = 1
seq_len = {seq_len}
steps = {STEPS}
[metrics]
log_freq = 1
enable_tensorboard = true
disable_color_printing = true
[debug]
seed = 0
[checkpoint]
enable = true
interval = {STEPS}
last_save_model_only = true
{load}"""


def test_each_stage_starts_from_the_previous_stage(tmp_path, scalars_of):
    previous = None
    for seq_len in LENGTHS:
        (tmp_path / f"s{seq_len}.toml").write_text(stage_toml(tmp_path, seq_len, previous))
        previous = seq_len
    env = {**os.environ, "STAGE_DIR": str(tmp_path),
           "STAGES": " ".join(f"s{n}" for n in LENGTHS), "NGPU": "1"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run(["bash", "scripts/run_stages.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    loads = [line for line in log.splitlines() if "Loading the checkpoint from" in line]
    assert [line.rstrip(".").rsplit("/", 3)[-3] for line in loads] == ["s256", "s512", "s1024"]

    for seq_len in LENGTHS:
        (run_dir,) = (tmp_path / f"s{seq_len}" / "tb").iterdir()
        assert [step for step, _ in scalars_of(run_dir, "loss_metrics/global_avg_loss")] == [1, 2]
        # Fresh warm-up in every stage: step 1 runs below the peak learning rate again.
        assert scalars_of(run_dir, "lr")[0][1] < LR

    final = tmp_path / "s2048.pt"
    dcp_to_torch_save(str(tmp_path / "s2048" / "checkpoint" / f"step-{STEPS}"), str(final))
    state = torch.load(final, weights_only=False)
    biases = [v for k, v in state.items() if k.endswith("router.expert_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)
