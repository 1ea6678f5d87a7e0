"""RMSNorm with `saves_output` (model/norm.py) against float64 F.rms_norm, eager and compiled:
its output and gradients, and what its backward keeps (its output, never its input).

Tolerances: float64, 1e-12 relative (x̂ = y / w is exact to rounding there). bf16: x̂ comes from
the output rounded to bf16 (2^-9 relative an element), so dx and dw stay within 2^-8 relative
RMS of the float64 gradients (seen 6e-4 and 1.8e-3); a wrong formula is off by O(1).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.metrics import rel_rms
from titan_moe.model import norm as norm_module
from titan_moe.model.args import get_flavor
from titan_moe.model.model import DecoderLayer
from titan_moe.model.norm import RMSNorm
from titan_moe.parallel.pipeline import boundary_tensors

BF16_BOUND = 2.0**-8
EPS = 1e-5


def inputs(dtype: torch.dtype, tokens: int = 96, dim: int = 64, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(0)
    x = (3 * torch.randn(2, tokens // 2, dim, device=device, generator=gen)).to(dtype)
    # Weights of both signs, away from 0 (the backward divides by them).
    w = (0.5 + torch.rand(dim, device=device, generator=gen))
    w = w * torch.where(torch.rand(dim, device=device, generator=gen) < 0.3, -1.0, 1.0)
    dy = torch.randn(x.shape, device=device, generator=gen).to(dtype)
    return x, w, dy


def reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """float64 F.rms_norm: output and (dx, dw)."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = F.rms_norm(x64, (x.shape[-1],), w64, EPS)
    return (y.detach(), *torch.autograd.grad(y, (x64, w64), dy.double()))


def saving_norm(w: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(w.shape[0], EPS, saves_output=True).to(w.device, w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


@contextlib.contextmanager
def saved_storages() -> Iterator[dict[int, torch.Tensor]]:
    """Storage id -> a tensor autograd saved on it, for what runs inside."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def run(norm: RMSNorm, x: torch.Tensor, dy: torch.Tensor, compiled: bool):
    """(y, dx, dw, the storages autograd saved, x's leaf)."""
    x = x.detach().requires_grad_()
    fn = torch.compile(norm, fullgraph=True) if compiled else norm
    with saved_storages() as saved:
        y = fn(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
    return y, dx, dw, saved, x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_saving_output_norm_equals_float64_rms_norm(compiled):
    x, w, dy = inputs(torch.float64)
    y, dx, dw, _, _ = run(saving_norm(w.double()), x, dy, compiled)
    y_ref, dx_ref, dw_ref = reference(x, w, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert rel_rms(got, want) < 1e-12


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_saving_output_norm_bf16_gradients_within_its_rounding(compiled):
    x, w, dy = inputs(torch.bfloat16)
    y, dx, dw, _, _ = run(saving_norm(w), x, dy, compiled)
    y_ref, dx_ref, dw_ref = reference(x, w, dy)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert rel_rms(y, y_ref) < 2.0**-8  # the output's own bf16 rounding
    assert rel_rms(dx, dx_ref) < BF16_BOUND
    assert rel_rms(dw, dw_ref) < BF16_BOUND


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_keeps_the_output_and_not_the_input(compiled):
    x, w, dy = inputs(torch.bfloat16)
    y, _, _, saved, leaf = run(saving_norm(w), x, dy, compiled)
    assert y.untyped_storage()._cdata in saved
    assert leaf.untyped_storage()._cdata not in saved
    # Nothing else of x's size: no fp32 copy of the input either.
    big = [t for t in saved.values() if t.numel() == x.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16


def test_without_grad_the_saving_norm_runs_the_fused_norm(monkeypatch):
    """Decoding (no autograd) keeps torch's fused rms_norm: the saving path is never entered."""
    x, w, _ = inputs(torch.bfloat16)
    norm = saving_norm(w)

    def entered(*args):
        raise AssertionError("the output-saving path ran")

    monkeypatch.setattr(norm_module._RMSNormSavingOutput, "apply", entered)
    with torch.no_grad():
        y = norm(x)
    assert rel_rms(y, reference(x, w, x)[0]) < 2.0**-8
    with pytest.raises(AssertionError, match="output-saving path"):
        norm(x)


def test_a_decoder_layer_with_saving_norms_computes_the_same_and_keeps_no_site_output():
    """A KDA + MoE layer by segments and token chunks (float64, eager), norm_saves_output on
    against off, the same weights: the same output and gradients (1e-10 relative), and the two
    AttnRes sites' outputs are saved by its backward only when off."""
    args = replace(get_flavor("debug"), seq_segment=64, moe_token_chunk=64)
    layer_id = 2
    assert not args.is_mla(layer_id) and args.is_moe(layer_id)
    torch.manual_seed(0)
    layers = {}
    for on in (False, True):
        layers[on] = DecoderLayer(layer_id, replace(args, norm_saves_output=on)).double()
    layers[False].init_weights()
    with torch.no_grad():  # norm weights and site queries away from their init
        for p in layers[False].parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    layers[True].load_state_dict(layers[False].state_dict())
    n_sources = boundary_tensors(args.attn_res_block_size, layer_id)
    sources = [torch.randn(1, 128, args.dim, dtype=torch.float64, requires_grad=True)
               for _ in range(n_sources)]
    results = {}
    for on, layer in layers.items():
        site_outputs = []
        hooks = [site.register_forward_hook(lambda m, i, o, outs=site_outputs: outs.append(o))
                 for site in (layer.mixer_site, layer.ffn_site)]
        with saved_storages() as saved:
            _, partial = layer(sources[:-1], sources[-1], None)
        for hook in hooks:
            hook.remove()
        grads = torch.autograd.grad(partial.square().sum(), sources + list(layer.parameters()))
        kept = [o.untyped_storage()._cdata in saved for o in site_outputs]
        results[on] = partial.detach(), grads, kept
    assert results[False][2] == [True, True] and results[True][2] == [False, False]
    for got, want in zip((results[True][0], *results[True][1]),
                         (results[False][0], *results[False][1]), strict=True):
        assert rel_rms(got, want) < 1e-10
