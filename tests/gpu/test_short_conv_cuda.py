"""The short-conv Triton op on CUDA (`pytest -m gpu`): against the float64 reference at the
proxy's shape (B 2, T 4096, H 16, D 128, documents of 2048 plus a few short ones), forward and
backward; opcheck with fake tensors; torch.compile(fullgraph=True) of the dispatcher and of a
KDA layer, forward and backward, against eager.

Errors are relative RMS, ||got − want|| / ||want||. fp32 x: FP32_RTOL for y, dx and dweight.
bf16 x: y and dx are rounded once to bf16 (round to nearest: relative RMS ≈ 2^-8/√6 ≈ 1.6e-3),
bound BF16_RTOL; dweight is fp32, computed from the same bf16 x and dy the reference sees:
FP32_RTOL.
"""

import pytest
import torch

from tests.metrics import rel_rms
from titan_moe.model.args import get_flavor
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.ops.short_conv import short_conv, short_conv_naive, short_conv_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP32_RTOL = 1e-5
BF16_RTOL = 4e-3
LAYER_RTOL = 2e-2  # a bf16 KDA layer, compiled vs eager (the KDA suite's gradient bound)


def proxy_inputs(dtype, batch=2, seq_len=4096, channels=2048, taps=4, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, seq_len, channels, device="cuda", generator=gen).to(dtype)
    weight = torch.rand(channels, taps, device="cuda", generator=gen) - 0.5
    dy = torch.randn(batch, seq_len, channels, device="cuda", generator=gen).to(dtype)
    doc = (torch.arange(seq_len, device="cuda") // 2048).to(torch.int32).expand(batch, -1)
    doc = doc.clone()
    doc[1, 100:] += 1  # short documents too, one starting at t = 1
    doc[1, 1:] += 1
    doc[1, 2050:] += 1
    return x, weight, dy, doc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, None])
@pytest.mark.parametrize("with_docs", [True, False])
def test_op_matches_float64_reference_at_proxy_shape(dtype, head_dim, with_docs):
    x, weight, dy, doc = proxy_inputs(dtype)
    doc = doc if with_docs else None
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    want = short_conv_naive(x64, w64, doc, head_dim)
    want_dx, want_dw = torch.autograd.grad((want * dy.double()).sum(), (x64, w64))
    ours_x, ours_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = short_conv(ours_x, ours_w, doc, head_dim)
    dx, dw = torch.autograd.grad(y, (ours_x, ours_w), dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, torch.float32)
    bound = BF16_RTOL if dtype == torch.bfloat16 else FP32_RTOL
    assert rel_rms(y, want) <= bound, rel_rms(y, want)
    assert rel_rms(dx, want_dx) <= bound, rel_rms(dx, want_dx)
    assert rel_rms(dw, want_dw) <= FP32_RTOL, rel_rms(dw, want_dw)


def test_opcheck_on_cuda():
    x, weight, _, doc = proxy_inputs(torch.bfloat16, seq_len=200, channels=256)
    torch.library.opcheck(short_conv_triton,
                          (x.requires_grad_(), weight.requires_grad_(), doc, 128))


def test_dispatcher_compiles_fullgraph_and_matches_eager():
    x, weight, dy, doc = proxy_inputs(torch.bfloat16, seq_len=1000, channels=512)
    x.requires_grad_()
    weight.requires_grad_()

    def run(fn):
        y = fn(x, weight, doc, 128)
        return [y, *torch.autograd.grad(y, (x, weight), dy)]

    eager = run(short_conv)
    compiled = run(torch.compile(short_conv, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        assert rel_rms(got, want) <= 1e-6


def _layer_run(layer, x, doc_ids, module=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = (layer if module is None else module)(x, doc_ids)
    params = [x, layer.conv_q, layer.conv_k, layer.conv_v, layer.w_q.weight, layer.w_v.weight]
    return [y, *torch.autograd.grad(y.float().square().mean(), params)]


def _proxy_layer():
    torch.manual_seed(0)
    args = get_flavor("proxy")
    layer = KimiDeltaAttention(args).cuda()
    layer.init_weights(0.02, 0.02)
    x = torch.randn(2, 512, args.dim, device="cuda", requires_grad=True)
    doc_ids = torch.zeros(2, 512, dtype=torch.int32, device="cuda")
    doc_ids[:, 300:] = 1
    doc_ids[1, 1:] += 1
    return layer, x, doc_ids


def test_kda_layer_compiles_fullgraph_and_matches_eager():
    layer, x, doc_ids = _proxy_layer()
    eager = _layer_run(layer, x, doc_ids)
    compiled = _layer_run(layer, x, doc_ids, torch.compile(layer, fullgraph=True))
    for i, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        assert rel_rms(got, want) <= LAYER_RTOL, (i, rel_rms(got, want))


def test_kda_layer_with_the_op_matches_the_reference_path(monkeypatch):
    """The layer's seam on CUDA: the Triton op against sequence_conv_act = the reference."""
    layer, x, doc_ids = _proxy_layer()
    ours = _layer_run(layer, x, doc_ids)
    monkeypatch.setattr(layer, "sequence_conv_act", short_conv_naive)
    want = _layer_run(layer, x, doc_ids)
    for i, (got, ref) in enumerate(zip(ours, want, strict=True)):
        assert rel_rms(got, ref) <= LAYER_RTOL, (i, rel_rms(got, ref))
