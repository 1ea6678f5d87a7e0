"""Compile by sublayer, around nested FSDP units: what gets compiled, without compiling anything
(torch.compile is lazy, so this inspects the wrapping only)."""

from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)

from tests.distributed.harness import build_model
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
