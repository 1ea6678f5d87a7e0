"""Every RL config in configs/ loads and passes validation (its checkpoint folder replaced by an
existing one: the configs name checkpoints that a pre-training run writes), and a bad value of
the new rollout options is one error naming the field."""

from pathlib import Path

import pytest

from titan_moe.model.args import ConfigError
from titan_moe.rl.config import load_rl_config

CONFIGS = sorted(Path("configs").glob("rl_*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_rl_config_loads(path, tmp_path):
    config = load_rl_config(path, {"model": {"checkpoint": str(tmp_path)}})
    assert config.rl.steps >= 1 and config.model_args().vocab_size > 0


def test_the_proxy_config_compiles_rollouts_under_autocast(tmp_path):
    config = load_rl_config("configs/rl_proxy.toml", {"model": {"checkpoint": str(tmp_path)}})
    assert config.model.flavor == "proxy" and config.rl.env == "python"
    assert config.rl.compile_rollouts and config.rl.autocast


@pytest.mark.parametrize("key", ["compile_rollouts", "autocast"])
def test_a_non_boolean_rollout_option_names_the_field(key, tmp_path):
    with pytest.raises(ConfigError, match=rf"rl\.{key} = 'yes': expected bool"):
        load_rl_config("configs/rl_proxy.toml", {"model": {"checkpoint": str(tmp_path)},
                                                 "rl": {key: "yes"}})
