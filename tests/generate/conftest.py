"""A tiny float32 model of the debug layout (KDA, MLA, dense and MoE FFNs, two AttnRes blocks)."""

import pytest
import torch

from titan_moe.model.args import apply_overrides, get_flavor
from titan_moe.model.model import TitanMoE

TINY = {
    "vocab_size": 96, "dim": 64, "n_layers": 4, "mla_layers": [2, 4], "dense_hidden": 64,
    "n_heads": 2, "head_dim": 16, "kda_gate_rank": 16, "mla_n_heads": 2, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_experts": 4, "top_k": 2, "latent_dim": 32, "expert_hidden": 32, "shared_hidden": 32,
}


def tiny_model(seed: int = 0, **overrides) -> TitanMoE:
    torch.manual_seed(seed)
    model = TitanMoE(apply_overrides(get_flavor("debug"), {**TINY, **overrides}))
    model.init_weights()
    with torch.no_grad():
        # Non-zero AttnRes queries and QB biases, so the mix and the routing are not trivial.
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0, 0.1)
    return model.eval()


@pytest.fixture
def model() -> TitanMoE:
    return tiny_model()


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def tiny_overrides() -> dict:
    return dict(TINY)
