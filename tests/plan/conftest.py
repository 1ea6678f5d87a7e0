"""The tiny plan config the plan tests share (3 layers in AttnRes blocks of 2, 8 experts)."""

import pytest

from titan_moe.plan.config import load_plan_config

TINY_TOML = """
[model]
flavor = "debug"
[titan_moe]
n_layers = 3
mla_layers = [3]
dim = 64
n_heads = 2
head_dim = 32
n_experts = 8
top_k = 2
latent_dim = 32
expert_hidden = 32
vocab_size = 128
[training]
seq_len = 64
local_batch_size = 2
[activation_checkpoint]
mode = "full"
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return load_plan_config(str(path))
