"""The context-stage chain on CPU: a tiny debug model at 64 -> 128 -> 256 tokens.

Each stage must start from the previous stage's final checkpoint (model with its QB biases;
fresh optimizer and LR warm-up) and log the long-context evaluation to TensorBoard at its last
step, exactly as the proxy chain in configs/stages/ does at 8K -> 64K -> 256K -> 1M (three
stages here: a first, one both loaded and loading, a last).

scripts/run_stages.sh runs one `run_train.sh` per stage, and each launch imports torch and
torchtitan twice (config check, trainer) for about 10 s on 2 cores; here the stages run one
after another in one child process through `titan_moe.train.trainer.main` (what run_train.sh's
torchrun child runs, config check included), so the imports are paid once, and without the 2 s
torchtitan sleeps at the end of each for other ranks (one rank here; trainer_process.NoSleep).
The script's own loop is checked by its error path. Dims, lengths and steps are the smallest
that keep the rest.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (64, 128, 256)
STEPS = 2
LR = 1e-3
TINY = """n_layers = 2
mla_layers = [2]
n_dense_layers = 0
dim = 64
n_heads = 2
head_dim = 32
kda_gate_rank = 16
mla_n_heads = 2
q_lora_rank = 32
kv_lora_rank = 16
qk_nope_head_dim = 16
qk_rope_head_dim = 16
v_head_dim = 16
n_experts = 8
top_k = 2
shared_hidden = 32
latent_dim = 32
expert_hidden = 32
"""


# One stage after another, as scripts/run_stages.sh does (each stage gets a fresh port).
CHAIN = """
import os, sys
import torchtitan.train
from tests.faults.trainer_process import NoSleep
from titan_moe.train.trainer import main
torchtitan.train.time = NoSleep()
for config in sys.argv[1:]:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(key, None)
    main(["--job.config_file", config])
"""


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
{TINY}
[optimizer]
lr = {LR}
[lr_scheduler]
warmup_steps = 2
[training]
device = "cpu"
local_batch_size = 1
mixed_precision_param = "float32"
seq_len = {seq_len}
steps = {STEPS}
loss_chunk = 64
[metrics]
log_freq = 1
enable_tensorboard = true
disable_color_printing = true
[debug]
seed = 0
[eval]
long_context = true
needle_lengths = [64]
needle_depths = [0.5]
needle_trials = 1
[activation_checkpoint]
mode = "none"
[checkpoint]
enable = true
interval = {STEPS}
last_save_model_only = true
{load}"""


def _biases(tmp_path: Path, stage: int) -> dict[str, torch.Tensor]:
    final = tmp_path / f"s{stage}.pt"
    dcp_to_torch_save(str(tmp_path / f"s{stage}" / "checkpoint" / f"step-{STEPS}"), str(final))
    state = torch.load(final, weights_only=False)
    return {k: v for k, v in state.items() if k.endswith("router.expert_bias")}


def test_each_stage_starts_from_the_previous_stage(tmp_path, scalars_of):
    previous = None
    for seq_len in LENGTHS:
        (tmp_path / f"s{seq_len}.toml").write_text(stage_toml(tmp_path, seq_len, previous))
        previous = seq_len
    # One thread: OpenMP's spinning threads slow these tiny matmuls tenfold on a shared CPU.
    env = {**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    configs = [str(tmp_path / f"s{n}.toml") for n in LENGTHS]
    result = subprocess.run([sys.executable, "-c", CHAIN, *configs], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    loads = [line for line in log.splitlines() if "Loading the checkpoint from" in line]
    assert [line.rstrip(".").rsplit("/", 3)[-3] for line in loads] == ["s64", "s128"]

    for seq_len in LENGTHS:
        (run_dir,) = (tmp_path / f"s{seq_len}" / "tb").iterdir()
        assert [step for step, _ in scalars_of(run_dir, "loss_metrics/global_avg_loss")] == [1, 2]
        # Fresh warm-up in every stage: step 1 runs below the peak learning rate again.
        assert scalars_of(run_dir, "lr")[0][1] < LR
        # The long-context evaluation of the stage's last step.
        for tag in ("long_context/loss_pos_0_1K", "long_context/needle_acc/len64_depth0.5"):
            assert [step for step, _ in scalars_of(run_dir, tag)] == [STEPS], tag

    # The model-only checkpoint a stage loads holds the QB biases (buffers of the routers),
    # and they keep moving: the last stage's differ from the first stage's.
    first, last = _biases(tmp_path, LENGTHS[0]), _biases(tmp_path, LENGTHS[-1])
    assert len(first) == 2 and first.keys() == last.keys()
    assert all(b.abs().sum() > 0 for b in first.values())
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_run_stages_stops_at_a_missing_stage_config(tmp_path):
    env = {**os.environ, "STAGE_DIR": str(tmp_path), "STAGES": "s64"}
    result = subprocess.run(["bash", "scripts/run_stages.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: stage config not found: {tmp_path}/s64.toml "
                                     f"(STAGE_DIR={tmp_path}, STAGES=s64)")


def test_short_stage_chain_configs_link_and_validate(tmp_path):
    """scripts/short_stages.py (the chain at short lengths on one GPU): every stage config passes
    the trainer's config check and starts from the previous stage's last checkpoint."""
    import importlib.util
    import tomllib

    from titan_moe.train.config import parse_job_config

    spec = importlib.util.spec_from_file_location("short_stages", REPO / "scripts/short_stages.py")
    short_stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(short_stages)
    assert short_stages.main(["--lengths", "8192,16384,32768", "--steps", "6",
                              "--out", str(tmp_path)]) == 0
    names = ["8k", "16k", "32k"]
    configs = {name: tomllib.loads((tmp_path / f"{name}.toml").read_text()) for name in names}
    for i, name in enumerate(names):
        config = configs[name]
        assert config["training"]["seq_len"] == 8192 * 2**i
        assert config["training"]["steps"] == config["checkpoint"]["interval"] == 6
        assert config["metrics"]["enable_tensorboard"] and config["eval"]["long_context"]
        load = config["checkpoint"].get("initial_load_path")
        assert load == (None if i == 0 else str(tmp_path / names[i - 1] / "checkpoint/step-6"))
        parse_job_config(["--job.config_file", str(tmp_path / f"{name}.toml"),
                          "--training.device", "cpu"])
    with pytest.raises(SystemExit):
        short_stages.main(["--lengths", "16384,8192", "--out", str(tmp_path)])
