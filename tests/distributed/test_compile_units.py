"""Compile by sublayer, around nested FSDP units: what gets compiled, without compiling anything
(torch.compile is lazy, so this inspects the wrapping only)."""

from dataclasses import replace

import pytest
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)

from tests.distributed.harness import build_model, tiny_args
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.model import TitanMoE
from titan_moe.model.moe import GroupedExperts
from titan_moe.parallel.parallelize import apply_compile, fsdp_units


def test_layers_without_units_compile_by_sublayer():
    model = build_model()
    apply_compile(model, "inductor", set())
    for layer in model.layers.values():
        assert not isinstance(layer, OptimizedModule)
        children = dict(layer.named_children())
        assert set(children) >= {"mixer", "ffn", "ffn_site", "mixer_norm", "ffn_norm"}
        assert all(isinstance(child, OptimizedModule) for child in children.values()), children


def test_whole_layers_for_op_level_selective_ac():
    model = build_model()
    apply_compile(model, "inductor", set(), whole_layers=True)
    assert all(isinstance(layer, OptimizedModule) for layer in model.layers.values())


def test_full_ac_wrapper_stays_eager_around_compiled_sublayers():
    model = build_model()
    model.layers.register_module("1", checkpoint_wrapper(model.layers["1"]))
    apply_compile(model, "inductor", set())
    wrapper = model.layers["1"]
    assert isinstance(wrapper, CheckpointWrapper)
    assert isinstance(wrapper._checkpoint_wrapped_module.mixer, OptimizedModule)


def test_units_stay_modules_and_the_code_between_them_compiles():
    model = build_model()
    units = fsdp_units(model, expert_parallel=True, fp32=True)
    apply_compile(model, "inductor", units)
    layer = model.layers["1"]
    assert not isinstance(layer, OptimizedModule)
    # Units keep their FSDP hooks on __call__; their forward is compiled, except EP experts.
    for unit in (layer.ffn_site, layer.ffn_norm, layer.ffn.router):
        assert not isinstance(unit, OptimizedModule)
        assert hasattr(unit.forward, "_torchdynamo_orig_callable")
    assert isinstance(layer.ffn.experts, GroupedExperts)
    assert not hasattr(layer.ffn.experts.forward, "_torchdynamo_orig_callable")
    # Unit-free subtrees compile whole: the shared expert, the latent projections, KDA's linears.
    for name in ("w_down", "w_up", "shared"):
        assert isinstance(getattr(layer.ffn, name), OptimizedModule), name
    assert isinstance(layer.mixer.w_q, OptimizedModule)


def test_sinked_sites_stay_eager_and_whole_layers_refuse_them():
    # Their backward adds into the blocks' gradient sinks, which no compiled graph may do.
    model = TitanMoE(replace(tiny_args(), attn_res_grad_sink=True))
    apply_compile(model, "inductor", set())
    layer = model.layers["1"]
    for site in (layer.mixer_site, layer.ffn_site):
        assert isinstance(site, AttnResSite) and site.grad_sink
    assert isinstance(layer.mixer, OptimizedModule) and isinstance(layer.ffn, OptimizedModule)
    with pytest.raises(ValueError, match="attn_res_grad_sink"):
        apply_compile(TitanMoE(replace(tiny_args(), attn_res_grad_sink=True)), "inductor", set(),
                      whole_layers=True)


def test_sinked_sites_refuse_data_parallel_sharding():
    # FSDP2 would fill the blocks' None gradients with zeros at every fp32 site unit.
    from types import SimpleNamespace

    from titan_moe.model.args import TitanMoEArgs
    from titan_moe.parallel.parallelize import parallelize_titan_moe
    from titan_moe.train.config import job_config_class

    dims = SimpleNamespace(tp_enabled=False, etp_enabled=False, cp_enabled=False,
                           ep_enabled=False, fsdp_enabled=True, dp_replicate_enabled=False)
    config = job_config_class(TitanMoEArgs)()
    model = TitanMoE(replace(tiny_args(), attn_res_grad_sink=True))
    with pytest.raises(ValueError, match="attn_res_grad_sink is for one GPU"):
        parallelize_titan_moe(model, dims, config)
