"""Flavors, parameter counts (meta device) and one clear error per inconsistent field."""

import subprocess
import sys

import pytest
import torch

from titan_moe.model.args import ConfigError, apply_overrides, get_flavor
from titan_moe.model.flops import count_params
from titan_moe.model.model import TitanMoE


def _counts(flavor: str):
    args = get_flavor(flavor)
    with torch.device("meta"):
        model = TitanMoE(args)
    return count_params(model, args)


def test_full_flavor_counts_match_spec():
    n = _counts("full")
    assert abs(n.total / 2.779e12 - 1) < 0.005, n
    assert abs(n.active / 104.2e9 - 1) < 0.005, n


def test_proxy_and_debug_counts_match_spec():
    proxy, debug = _counts("proxy"), _counts("debug")
    assert abs(proxy.total / 2.97e9 - 1) < 0.02, proxy
    assert abs(proxy.active / 0.92e9 - 1) < 0.02, proxy
    assert 15e6 < debug.total < 21e6, debug


def test_full_flavor_mla_schedule():
    args = get_flavor("full")
    assert args.mla_layers == tuple(range(4, 93, 4)) + (93,)
    assert len(args.mla_layers) == 24 and args.n_layers - len(args.mla_layers) == 69


def test_params_cli_prints_units():
    out = subprocess.run([sys.executable, "-m", "titan_moe.plan.params", "--flavor", "full"],
                         capture_output=True, text=True, check=True).stdout
    assert "total parameters" in out and "T parameters" in out
    assert "active parameters" in out and "B parameters" in out


@pytest.mark.parametrize("overrides, field", [
    ({"kda_dim": 100}, "kda_dim"),
    ({"qk_head_dim": 100}, "qk_head_dim"),
    ({"top_k": 17}, "top_k"),
    ({"kda_g_min": 0.0}, "kda_g_min"),
    ({"mla_layers": [9]}, "mla_layers"),
    ({"mla_layers": [0]}, "mla_layers"),
    ({"n_layers": "eight"}, "n_layers"),
    ({"n_layers": True}, "n_layers"),  # a bool is not an int
    ({"mla_layers": [2.5]}, "mla_layers"),  # the list's items are typed too
    ({"not_a_field": 1}, "not_a_field"),
    ({"moe_token_chunk": -1}, "moe_token_chunk"),
    ({"seq_segment": -64}, "seq_segment"),
    ({"seq_segment": 100}, "seq_segment"),  # not a multiple of the KDA chunk (64)
    ({"seq_segment": 64, "kda_conv_size": 66}, "seq_segment"),  # shorter than the conv's taps
    ({"norm_saves_output": 1}, "norm_saves_output"),
])
def test_inconsistent_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"titan_moe\.{field}\b"):
        apply_overrides(get_flavor("debug"), overrides)


def test_overrides_take_toml_forms():
    """TOML gives lists for tuples and ints for floats: the one type check accepts both."""
    args = apply_overrides(get_flavor("debug"), {"mla_layers": [2, 4], "norm_eps": 1})
    assert args.mla_layers == (2, 4) and args.norm_eps == 1


def test_moe_token_chunk_and_seq_segment_reach_their_sublayers():
    # The MoE layers take moe_token_chunk; the dense FFN and the KDA and MLA mixers seq_segment.
    args = apply_overrides(get_flavor("debug"), {"moe_token_chunk": 4096, "seq_segment": 128})
    with torch.device("meta"):
        model = TitanMoE(args)
    chunks = {i: layer.ffn.token_chunk for i, layer in model.layers.items()}
    assert chunks == {str(i): 4096 if args.is_moe(i) else 128 for i in range(args.n_layers)}
    assert {layer.mixer.seq_segment for layer in model.layers.values()} == {128}
    assert any(args.is_mla(i) for i in range(args.n_layers))


def test_unknown_flavor_lists_allowed():
    with pytest.raises(ConfigError, match=r"model\.flavor.*debug.*full.*proxy"):
        get_flavor("huge")
