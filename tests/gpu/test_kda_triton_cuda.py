"""The KDA CUDA backends in bf16: our Triton op and the fla-backed custom op (`fla_backend.py`),
each against float64; ours also against fla-core 0.6.0's own `chunk_kda`.

Errors are relative RMS, ||got - want|| / ||want||, per output and per gradient (q, k, v, g,
beta, initial state; A_log, dt_bias for the fused gate). Bounds (the KDA issue's): 5e-3 for the
output, 2e-2 for gradients, in bf16. The float64 reference is chunk_kda_torch (equal to the
recurrence to 1e-10, tests/ops/test_kda_reference.py); fla runs with safe_gate=True,
lower_bound=-5 on the same bf16 inputs.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.metrics import rel_rms
from tests.ops.zero_fills import ZeroFills
from titan_moe.model.args import get_flavor
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.ops.kda import chunk_kda_fla, chunk_kda_torch, chunk_kda_triton, kda_gate
from titan_moe.ops.kda.chunk_triton import (
    chunk_kda_bwd_intra,
    chunk_kda_bwd_state_terms,
    chunk_kda_bwd_states,
    chunk_kda_fwd,
)
from titan_moe.ops.kda.fla_backend import FLA_INSTALLED, fla_kda_fwd, use_tuned_fla_configs
from titan_moe.ops.kda.varlen import doc_index_from_cu_seqlens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

O_RMS = 5e-3
GRAD_RMS = 2e-2
G_MIN = -5.0

# name -> (batch, seq_len, heads, head_dim, gate, cu_seqlens or None)
CASES = {
    "B2-T200-random": (2, 200, 4, 128, "random", None),
    "B1-T1000-pinned": (1, 1000, 2, 128, "pinned", None),
    "B3-T333-near-zero": (3, 333, 3, 64, "near_zero", None),
    "varlen": (1, 700, 2, 128, "random", [0, 5, 64, 200, 201, 450, 700]),
    "fused-gate": (2, 300, 2, 128, "fused", None),
    # The proxy's heads (16 x 128): fla autotunes its kernels anew at every head count, kernel
    # variant and dtype, minutes each, so its cases share the model's and add few variants.
    "H16-T200-random": (2, 200, 16, 128, "random", None),
    "H16-T1000-pinned": (1, 1000, 16, 128, "pinned", None),
    "H16-varlen": (1, 700, 16, 128, "random", [0, 5, 64, 200, 201, 450, 700]),
    "H16-varlen-fused-gate": (1, 700, 16, 128, "fused", [0, 5, 64, 200, 201, 450, 700]),
}
FLA_CASES = [name for name in CASES if name.startswith("H16-")]


def make_case(batch, seq_len, heads, d, gate, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, seq_len, heads, d)
    f32 = dict(device="cuda", generator=gen)
    q = F.normalize(torch.randn(shape, **f32), dim=-1)
    k = F.normalize(torch.randn(shape, **f32), dim=-1)
    v = torch.randn(shape, **f32)
    u = torch.rand(shape, **f32)
    g = {"pinned": torch.full(shape, G_MIN, device="cuda"), "near_zero": -1e-3 * u,
         "random": G_MIN * u, "fused": 3 * torch.randn(shape, **f32)}[gate]
    beta = torch.rand(batch, seq_len, heads, **f32)
    h0 = torch.randn(batch, heads, d, d, **f32)
    A_log, dt_bias = 0.5 * torch.randn(heads, **f32), torch.randn(heads * d, **f32)
    return q, k, v, g, beta, h0, A_log, dt_bias


def fla_chunk_kda():
    use_tuned_fla_configs()
    fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core (the anchor) not installed")
    return fla_kda.chunk_kda


def kda_case(name):
    """(bf16 + fp32 leaves, loss, initial-state picker, cu_seqlens or None, fused gate?)."""
    batch, seq_len, heads, d, gate, offsets = CASES[name]
    q, k, v, g, beta, h0, A_log, dt_bias = make_case(batch, seq_len, heads, d, gate)
    fused = gate == "fused"
    cu = None if offsets is None else torch.tensor(offsets, device="cuda")
    with_states = cu is None
    leaves = [x.bfloat16() for x in (q, k, v, g, beta)]
    leaves += [h0] if with_states else []
    leaves += [A_log, dt_bias] if fused else []
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(batch, seq_len, heads, d, device="cuda", generator=gen)
    ds = torch.randn(batch, heads, d, d, device="cuda", generator=gen)

    def loss(o, s):
        total = (o.float() * do).sum()
        return total + (s.float() * ds).sum() if with_states else total

    initial = (lambda xs: xs[5]) if with_states else (lambda xs: None)
    return leaves, loss, initial, cu, fused


BACKENDS = {"triton": chunk_kda_triton, "fla": chunk_kda_fla}
needs_fla = pytest.mark.skipif(not FLA_INSTALLED, reason="fla-core (the anchor) not installed")
BACKEND_PARAMS = ["triton", pytest.param("fla", marks=needs_fla)]


def ours_and_grads(name, backend="triton"):
    leaves, loss, initial, cu, fused = kda_case(name)
    ours = [x.detach().clone().requires_grad_() for x in leaves]
    seq_len = ours[0].shape[1]
    doc = None if cu is None else doc_index_from_cu_seqlens(cu, seq_len)[None]
    gate_args = dict(A_log=ours[-2], dt_bias=ours[-1], g_min=G_MIN) if fused else {}
    o, s = BACKENDS[backend](*ours[:5], initial_state=initial(ours),
                             output_final_state=cu is None, doc=doc, **gate_args)
    assert o.dtype == torch.bfloat16
    return o, s, torch.autograd.grad(loss(o, s), ours)


BACKEND_CASES = [("triton", name) for name in CASES]
BACKEND_CASES += [pytest.param("fla", name, marks=needs_fla) for name in FLA_CASES]


@pytest.mark.parametrize(("backend", "name"), BACKEND_CASES)
def test_bf16_op_matches_float64(name, backend):
    leaves, loss, initial, cu, fused = kda_case(name)
    leaves64 = [x.double().requires_grad_() for x in leaves]
    g64 = kda_gate(leaves64[3], leaves64[-2], leaves64[-1], G_MIN) if fused else leaves64[3]
    o64, s64 = chunk_kda_torch(*leaves64[:3], g64, leaves64[4], initial_state=initial(leaves64),
                               output_final_state=cu is None, cu_seqlens=cu)
    want = torch.autograd.grad(loss(o64, s64), leaves64)
    o, s, got = ours_and_grads(name, backend)
    assert rel_rms(o, o64) <= O_RMS
    if cu is None:
        assert rel_rms(s, s64) <= O_RMS
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_rms(a, b) <= GRAD_RMS, (i, rel_rms(a, b))


@pytest.mark.parametrize("name", FLA_CASES)
def test_bf16_op_matches_fla(name):
    fla = fla_chunk_kda()
    leaves, loss, initial, cu, fused = kda_case(name)
    theirs = [x.detach().clone().requires_grad_() for x in leaves]
    fla_gate = dict(use_gate_in_kernel=True, A_log=theirs[-2], dt_bias=theirs[-1]) if fused else {}
    o_fla, s_fla = fla(*theirs[:5], initial_state=initial(theirs), output_final_state=cu is None,
                       cu_seqlens=cu, safe_gate=True, lower_bound=G_MIN, **fla_gate)
    want = torch.autograd.grad(loss(o_fla, s_fla), theirs)
    o, _, got = ours_and_grads(name)
    assert rel_rms(o, o_fla) <= O_RMS
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_rms(a, b) <= GRAD_RMS, (i, rel_rms(a, b))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_opcheck_fake_tensor_and_autograd(backend):
    q, k, v, g, beta, h0, _, _ = make_case(1, 130, 16, 128, "random")
    args = [x.bfloat16().requires_grad_() for x in (q, k, v, g, beta)]
    args += [None, None, None, h0, 128**-0.5, G_MIN, True]
    args += [True] if backend == "triton" else [False]  # ours' keep, fla's static_layout
    torch.library.opcheck({"triton": chunk_kda_fwd, "fla": fla_kda_fwd}[backend], args)


def test_opcheck_the_kept_backward_ops():
    """The three ops of the backward from the forward's kept buffers: schema (d_w the only input
    written), fake shapes against the real ones, autograd registration and AOT dispatch."""
    q, k, v, g, beta, h0, _, _ = make_case(1, 130, 16, 128, "random")
    q, k, v, g, beta = (x.bfloat16() for x in (q, k, v, g, beta))
    scale = 128**-0.5
    o, _, A_qk, KK, Tinv, G, W, K_d, h_states, v_new = chunk_kda_fwd(
        q, k, v, g, beta, None, None, None, h0, scale, G_MIN, True, True)
    do, d_final = torch.randn_like(o), torch.randn_like(h0)
    args = (q, G, A_qk, K_d, W, None, do, d_final, h0, scale)
    torch.library.opcheck(chunk_kda_bwd_states, args)
    dh_states, dv_new, _ = chunk_kda_bwd_states(*args)
    args = (q, do, v_new, dv_new, h_states, dh_states, None)
    torch.library.opcheck(chunk_kda_bwd_state_terms, args)
    d_qg, d_w, d_kd, d_gamma = chunk_kda_bwd_state_terms(*args)
    args = (q, k, v, g, beta, None, None, None, G, KK, Tinv, v_new, dv_new, do, d_qg, d_w, d_kd,
            d_gamma, scale, G_MIN)
    torch.library.opcheck(chunk_kda_bwd_intra, args)


class _TwoOutputs(torch.autograd.Function):
    """The control: autograd fills a zero gradient for the output the loss does not reach."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, dy, dz):
        return 2 * dy + 3 * dz


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_backward_fills_no_gradient_for_outputs_the_loss_does_not_reach(backend):
    """Autograd fills a zero gradient for every output of a custom op that gets none unless its
    context turns that off; ours' kept buffers and fla's chunk matrices are outputs, so each was
    filled at the backward's start (ours: 2.5 GiB at 64K x 16 heads). ZeroFills sees the
    control's fill on the CUDA backward thread, and none of the op's. A loss on the final state
    alone gives, bit for bit, the gradients of that loss with an explicit zero dO."""
    leaves, _, _, _, _ = kda_case("H16-T200-random")
    leaves = [x.detach().requires_grad_() for x in leaves]

    def op():
        return BACKENDS[backend](*leaves[:5], initial_state=leaves[5], output_final_state=True)

    x = torch.ones(8, device="cuda", requires_grad=True)
    with ZeroFills() as control:
        torch.autograd.grad(_TwoOutputs.apply(x)[0].sum(), x)
    assert ("zeros", [8], "torch.float32") in control.fills, control.fills
    o, _ = op()
    with ZeroFills() as zeros:
        torch.autograd.grad(o.float().sum(), leaves)
    assert zeros.fills == [], zeros.fills
    o, s = op()
    ds = torch.randn_like(s)
    lone = torch.autograd.grad(s, leaves, ds)
    o, s = op()
    explicit = torch.autograd.grad((o, s), leaves, (torch.zeros_like(o), ds))
    for i, (a, b) in enumerate(zip(lone, explicit, strict=True)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("gate", ["fused", "random"], ids=["fused-gate", "g-given"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_op_compiles_fullgraph_and_matches_eager(backend, gate):
    """The op alone, both entries (the fused gate, g given), documents on, at the proxy's
    heads: a quick compile check."""
    q, k, v, g, beta, _, A_log, dt_bias = make_case(2, 200, 16, 128, gate)
    fused = gate == "fused"
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v, g, beta)]
    leaves += [A_log.requires_grad_(), dt_bias.requires_grad_()] if fused else []
    doc = torch.zeros(2, 200, dtype=torch.int32, device="cuda")
    doc[:, 90:] = 1

    def run(fn):
        o, _ = fn(*leaves)
        return [o, *torch.autograd.grad(o.float().square().sum(), leaves)]

    def op(q, k, v, g, beta, A_log=None, dt_bias=None):
        gate_args = dict(A_log=A_log, dt_bias=dt_bias, g_min=G_MIN) if fused else {}
        return BACKENDS[backend](q, k, v, g, beta, doc=doc, **gate_args)

    eager = run(op)
    compiled = run(torch.compile(op, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        assert rel_rms(got, want) <= 1e-3


def test_op_by_segments_equals_the_whole_op_eager_and_compiled(monkeypatch):
    """T 1000 in segments of 256 (the last partial; a document begins at 512, one crosses 256):
    the same kernels with the state handed over in fp32, so the outputs and the gradients of
    q, k, v, g, beta and the initial state are the whole op's bit for bit eager. dA_log and
    d_dt_bias are fp32 sums of per-chunk partials, added by segment first, so only their order
    differs: within 1e-6 (measured 7e-8 under the interpreter). Compiled: all within 1e-3
    (fullgraph: the segment loop traces)."""
    import importlib

    chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")
    q, k, v, g, beta, h0, A_log, dt_bias = make_case(2, 1000, 4, 128, "fused")
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v, g, beta)]
    leaves += [h0.requires_grad_(), A_log.requires_grad_(), dt_bias.requires_grad_()]
    doc = torch.zeros(2, 1000, dtype=torch.int32, device="cuda")
    doc[:, 200:] = 1
    doc[0, 512:] = 2

    def op(q, k, v, g, beta, h0, A_log, dt_bias):
        return chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                doc=doc, A_log=A_log, dt_bias=dt_bias, g_min=G_MIN)

    def run(fn):
        o, s = fn(*leaves)
        return [o, s, *torch.autograd.grad(o.float().square().sum() + s.square().sum(), leaves)]

    whole = run(op)
    monkeypatch.setattr(chunk_triton, "SEGMENT", 256)
    by_segments = run(op)
    for got, want in zip(by_segments[:-2], whole[:-2], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(by_segments[-2:], whole[-2:], strict=True):
        assert rel_rms(got, want) <= 1e-6
    compiled = run(torch.compile(op, fullgraph=True))
    for got, want in zip(compiled, whole, strict=True):
        assert rel_rms(got, want) <= 1e-3


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_kda_layer_compiles_fullgraph_and_matches_eager(backend):
    """fullgraph=True rejects any graph break, so compiling at all proves there is none."""
    torch.manual_seed(0)
    args = get_flavor("proxy")
    args.kda_backend = backend
    layer = KimiDeltaAttention(args).cuda()
    layer.init_weights(0.02, 0.02)
    x = torch.randn(2, 512, args.dim, device="cuda", requires_grad=True)
    doc_ids = torch.zeros(2, 512, dtype=torch.int32, device="cuda")
    doc_ids[:, 300:] = 1

    def run(module):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x, doc_ids)
        params = [x, layer.A_log, layer.dt_bias, layer.w_q.weight, layer.w_f_up.weight]
        return [y, *torch.autograd.grad(y.float().square().mean(), params)]

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        assert rel_rms(got, want) <= GRAD_RMS
