"""Chunked KDA (plain PyTorch) against the float64 token-by-token recurrence."""

import math

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F

from tests.metrics import rel_max
from tests.scalar_cpp import scalar_cpp
from titan_moe.ops.kda import chunk_kda, chunk_kda_torch, kda_gate, naive_recurrent_kda

EXACT_RTOL = 1e-10  # chunked vs recurrence, float64
GRAD_RTOL = 1e-9  # gradients, float64
FP32_RTOL = 1e-4  # float32 chunked vs float64 recurrence
COMPILE_RTOL = 1e-5  # compiled vs eager, float32
G_MIN = -5.0
HEADS, D_K, D_V = 2, 16, 8


def make_inputs(batch, seq_len, gate="random", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, HEADS, D_K)
    q = F.normalize(torch.randn(shape, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(shape, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(batch, seq_len, HEADS, D_V, generator=gen, dtype=dtype)
    u = torch.rand(shape, generator=gen, dtype=dtype)
    if gate == "pinned":
        g = (G_MIN - 1e-6 * u).clamp(min=G_MIN)
    elif gate == "near_zero":
        g = -1e-3 * u
    else:
        g = G_MIN * u
    beta = torch.rand(batch, seq_len, HEADS, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def random_state(n, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, D_K, D_V, generator=gen, dtype=dtype)


@pytest.mark.parametrize("gate", ["pinned", "near_zero", "random"])
@pytest.mark.parametrize("seq_len", [100, 130])
def test_chunked_matches_recurrence(gate, seq_len):
    q, k, v, g, beta = make_inputs(2, seq_len, gate)
    h0 = random_state(2)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_max(o, o_ref) <= EXACT_RTOL
    assert rel_max(s, s_ref) <= EXACT_RTOL


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_other_chunk_sizes_match_recurrence(chunk_size):
    q, k, v, g, beta = make_inputs(1, 50)
    o, s = chunk_kda_torch(q, k, v, g, beta, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert rel_max(o, o_ref) <= EXACT_RTOL
    assert rel_max(s, s_ref) <= EXACT_RTOL


CU_SEQLENS_CASES = {
    # short documents (< 16), an empty one, starts mid-subtile and mid-chunk, one spanning
    # three chunks, and a padded tail
    "ragged": [0, 7, 7, 23, 30, 150, 163, 200],
    # boundaries on chunk edges, a 3-token document, a whole-chunk document
    "aligned": [0, 64, 128, 131, 200],
}


@pytest.mark.parametrize("case", list(CU_SEQLENS_CASES))
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_cu_seqlens_match_recurrence(case, with_initial_state):
    offsets = torch.tensor(CU_SEQLENS_CASES[case], dtype=torch.int32)
    q, k, v, g, beta = make_inputs(1, int(offsets[-1]))
    h0 = random_state(len(offsets) - 1) if with_initial_state else None
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=offsets)
    o, s = chunk_kda_torch(q, k, v, g, beta, **kwargs)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kwargs)
    assert s.shape == (len(offsets) - 1, HEADS, D_K, D_V)
    assert rel_max(o, o_ref) <= EXACT_RTOL
    assert rel_max(s, s_ref) <= EXACT_RTOL


def test_doc_ids_match_recurrence_per_row():
    seq_len = 150
    lengths = [[10, 60, 3, 77], [64, 1, 85]]
    doc_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    )
    q, k, v, g, beta = make_inputs(2, seq_len, seed=3)
    h0 = random_state(2)
    o, s = chunk_kda_torch(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, doc_ids=doc_ids
    )
    for b, row in enumerate(lengths):
        offsets = torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()])
        h0_row = torch.zeros(len(row), HEADS, D_K, D_V, dtype=torch.float64)
        h0_row[0] = h0[b]  # only the row's first document continues from initial_state
        o_ref, s_ref = naive_recurrent_kda(
            *(x[b : b + 1] for x in (q, k, v, g, beta)),
            initial_state=h0_row,
            output_final_state=True,
            cu_seqlens=offsets,
        )
        assert rel_max(o[b : b + 1], o_ref) <= EXACT_RTOL
        assert rel_max(s[b], s_ref[-1]) <= EXACT_RTOL


def _grads(fn, inputs, offsets, o_weight, s_weight):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = inputs
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offsets)
    loss = (o * o_weight).sum() + (s * s_weight).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 9, 40, 90]])
def test_gradients_match_recurrence(cu_seqlens):
    offsets = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    batch = 2 if offsets is None else 1
    n_states = batch if offsets is None else len(cu_seqlens) - 1
    q, k, v, g, beta = make_inputs(batch, 90, seed=5)
    inputs = [q, k, v, g, beta, random_state(n_states)]
    gen = torch.Generator().manual_seed(7)
    weights = (
        torch.randn(v.shape, generator=gen, dtype=torch.float64),
        torch.randn(inputs[-1].shape, generator=gen, dtype=torch.float64),
    )
    got = _grads(chunk_kda_torch, inputs, offsets, *weights)
    expected = _grads(naive_recurrent_kda, inputs, offsets, *weights)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for name, a, b in zip(names, got, expected, strict=True):
        assert rel_max(a, b) <= GRAD_RTOL, name


def test_subtile_reference_keeps_float32_finite():
    # Referencing a whole 64-token chunk at its start needs exp(G_n - G_j) up to exp(315)...
    G = torch.full((64,), G_MIN, dtype=torch.float32).cumsum(0)
    assert torch.isinf(torch.exp(G[0] - G)).any()
    # ...while a 16-token tile referenced at its first row stays within 75 nats.
    assert torch.isfinite(torch.exp(G[0] - G[:16])).all()

    q, k, v, g, beta = make_inputs(1, 128, gate="pinned")
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_max(o.double(), o_ref) <= FP32_RTOL
    assert rel_max(s.double(), s_ref) <= FP32_RTOL


def test_compiled_matches_eager():
    q, k, v, g, beta = (x.float() for x in make_inputs(1, 80))
    offsets = torch.tensor([0, 5, 33, 80], dtype=torch.int32)
    kwargs = dict(output_final_state=True, cu_seqlens=offsets)
    o, s = chunk_kda_torch(q, k, v, g, beta, **kwargs)
    compiled = torch.compile(chunk_kda_torch, fullgraph=True, dynamic=False)
    with scalar_cpp():  # tracing and lowering are what is tested
        o_c, s_c = compiled(q, k, v, g, beta, **kwargs)
    assert rel_max(o_c, o) <= COMPILE_RTOL
    assert rel_max(s_c, s) <= COMPILE_RTOL


def test_public_chunk_kda_matches_recurrence():
    q, k, v, g, beta = make_inputs(2, 40)
    o, _ = chunk_kda(q, k, v, g, beta, scale=0.3)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    assert rel_max(o, o_ref) <= EXACT_RTOL


def test_kda_gate_matches_scalar_formula():
    gen = torch.Generator().manual_seed(11)
    g_raw = 4 * torch.randn(2, 3, HEADS, D_K, generator=gen)
    A_log = torch.randn(HEADS, generator=gen)
    dt_bias = torch.randn(HEADS * D_K, generator=gen)
    g = kda_gate(g_raw.bfloat16(), A_log, dt_bias)
    assert g.dtype == torch.float32
    g_raw = g_raw.bfloat16().float()
    for b, t, h, c in [(0, 0, 0, 0), (1, 2, 1, D_K - 1), (0, 1, 1, 5)]:
        x = math.exp(A_log[h].item()) * (g_raw[b, t, h, c].item() + dt_bias[h * D_K + c].item())
        expected = G_MIN / (1 + math.exp(-x))
        assert abs(g[b, t, h, c].item() - expected) <= 1e-6
    assert (g >= G_MIN).all() and (g <= 0).all()  # sigmoid saturates to g_min in fp32


BAD_INPUTS = {
    "k": lambda a: {**a, "k": a["k"][..., :-1]},
    "v": lambda a: {**a, "v": a["v"][:, :-1]},
    "beta": lambda a: {**a, "beta": a["beta"][..., None]},
    "initial_state": lambda a: {**a, "initial_state": random_state(3)},
    "cu_seqlens": lambda a: {**a, "cu_seqlens": torch.tensor([0, 4, 10])},
    "doc_ids": lambda a: {**a, "doc_ids": torch.zeros(2, 9, dtype=torch.long)},
    "both": lambda a: {
        **a,
        "cu_seqlens": torch.tensor([0, 10]),
        "doc_ids": torch.zeros(2, 10, dtype=torch.long),
    },
    "chunk_size": lambda a: {**a, "chunk_size": 24},
}


@pytest.mark.parametrize("argument", list(BAD_INPUTS))
def test_bad_inputs_name_the_argument(argument):
    q, k, v, g, beta = make_inputs(2, 10)
    args = BAD_INPUTS[argument](dict(q=q, k=k, v=v, g=g, beta=beta))
    expected = "cu_seqlens and doc_ids" if argument == "both" else argument
    with pytest.raises(ValueError, match=expected):
        chunk_kda_torch(**args)
