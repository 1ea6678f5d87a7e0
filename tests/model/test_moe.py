import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.scalar_cpp import scalar_cpp
from titan_moe.model import token_chunks
from titan_moe.model.moe import LatentMoE
from titan_moe.model.router import Router
from titan_moe.ops.grouped_mm import grouped_mm, grouped_mm_reference
from titan_moe.ops.moe_dispatch import dispatch_layout
from titan_moe.ops.router import topk_lowest_index_on_ties

FLOAT64_TOL = 1e-10
COMPILE_TOL = 1e-5  # float32, relative to the largest magnitude of the tensor (at least 1)
BETA1, BETA2 = 4.0, 25.0


def _naive_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        for m in range(start, end):
            out[m] = x[m] @ w[e]
        start = end
    return out


@pytest.mark.parametrize("impl", [grouped_mm, grouped_mm_reference], ids=["eager", "traceable"])
def test_grouped_mm_fallback_matches_loop_with_empty_groups_and_padding(impl):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 5, 3, generator=gen, dtype=torch.float64)
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # group 1 empty, rows 10..12 padding
    out = impl(x, w, offs)
    torch.testing.assert_close(out, _naive_grouped_mm(x, w, offs), rtol=0, atol=1e-13)
    assert out[10:].abs().max().item() == 0.0
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: impl(x, w, offs), (x, w))


def _naive_topk(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_breaks_ties_towards_lower_index(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    # Few distinct levels, both zeros and negatives, so most rows are full of ties.
    levels = torch.tensor([-2.5, -1e-30, -0.0, 0.0, 1e-30, 0.75, 0.75 + 2**-20, 3.0])
    values = levels[torch.randint(len(levels), (64, 11), generator=gen)].to(dtype)
    top_values, ids = topk_lowest_index_on_ties(values, 5)
    for row, row_ids, row_values in zip(values.tolist(), ids.tolist(), top_values, strict=True):
        assert row_ids == _naive_topk(row, 5)
        assert row_values.tolist() == [row[e] for e in row_ids]


def test_router_weights_renormalise_unbiased_scores():
    torch.manual_seed(2)
    router = Router(dim=8, n_experts=6, top_k=3, route_scale=2.5).double()
    router.init_weights(init_std=0.5)
    router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.25]))
    x = torch.randn(20, 8, dtype=torch.float64)
    ids, weights = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    for t in range(20):
        chosen = _naive_topk((scores[t] + router.expert_bias).tolist(), 3)
        assert ids[t].tolist() == chosen
        expected = scores[t, chosen] / scores[t, chosen].sum() * 2.5
        torch.testing.assert_close(weights[t], expected, rtol=0, atol=1e-14)


def _situ_glu_formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return BETA1 * torch.tanh(a / BETA1) * torch.sigmoid(a) * BETA2 * torch.tanh(b / BETA2)


def _naive_latent_moe(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the spec §5 equations."""
    router, experts = moe.router, moe.experts
    x_flat = x.reshape(-1, x.shape[-1])
    rows = []
    for x_t in x_flat:
        s = torch.sigmoid(router.weight @ x_t)
        chosen = _naive_topk((s.detach() + router.expert_bias).tolist(), moe.top_k)
        z = moe.w_down.weight @ x_t
        u = torch.zeros_like(z)
        for e in chosen:
            w1, w3 = experts.w13[e].chunk(2)  # w13 = [W1; W3]
            h = _situ_glu_formula(w1 @ z, w3 @ z)
            p_e = s[e] / sum(s[j] for j in chosen) * router.route_scale
            u = u + p_e * (experts.w2[e] @ h)
        normed = u / torch.sqrt(u.square().mean() + moe.norm.eps) * moe.norm.weight
        y = moe.w_up.weight @ normed
        if moe.shared is not None:
            shared = moe.shared
            w1, w3 = shared.w13.weight.chunk(2)
            h = _situ_glu_formula(w1 @ x_t, w3 @ x_t)
            y = y + shared.w2.weight @ h
        rows.append(y)
    return torch.stack(rows).view_as(x)


def _small_moe(
    n_shared: int, seed: int, dtype: torch.dtype = torch.float64, group_align: int = 8
) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(
        dim=12,
        n_experts=6,
        top_k=2,
        n_shared=n_shared,
        latent_dim=8,
        expert_hidden=10,
        shared_hidden=7,
        route_scale=1.7,
        group_align=group_align,
    )
    moe.init_weights(init_std=0.4, out_init_std=0.3)
    moe = moe.to(dtype)
    with torch.no_grad():
        moe.norm.weight.copy_(torch.rand(8) + 0.5)
        moe.router.expert_bias.copy_(torch.randn(6) * 0.2)
    return moe


@pytest.mark.parametrize(("n_shared", "group_align"), [(2, 8), (0, 1), (1, 3)])
def test_latent_moe_matches_naive_loop_float64(n_shared: int, group_align: int):
    moe = _small_moe(n_shared, seed=3, group_align=group_align)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(2, 5, 12, dtype=torch.float64)

    out = moe(x)
    (out * grad_out).sum().backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad()
    expected = _naive_latent_moe(moe, x_ref)
    (expected * grad_out).sum().backward()

    assert (out - expected).abs().max().item() <= FLOAT64_TOL
    assert (x.grad - x_ref.grad).abs().max().item() <= FLOAT64_TOL
    for name, p in moe.named_parameters():
        assert p.grad.abs().max().item() > 0, name
        assert (grads[name] - p.grad).abs().max().item() <= FLOAT64_TOL, name
    # The bias must have changed some selections, or the check above would not cover it.
    scores = torch.sigmoid(x.detach().view(-1, 12) @ moe.router.weight.T)
    unbiased = scores.topk(2).indices.sort().values
    biased = (scores + moe.router.expert_bias).topk(2).indices.sort().values
    assert not torch.equal(unbiased, biased)


@pytest.mark.parametrize("align", [1, 4, 16])
def test_dispatch_layout_groups_pairs_in_aligned_blocks(align: int):
    gen = torch.Generator().manual_seed(7)
    n_experts = 6
    pair_expert = torch.randint(n_experts, (41,), generator=gen)
    pair_expert[pair_expert == 2] = 3  # an empty group
    dest, src, offs = dispatch_layout(pair_expert, n_experts, align)
    n_rows = src.numel()
    assert offs.dtype == torch.int32 and n_rows % align == 0
    assert n_rows == -(-(41 + n_experts * (align - 1)) // align) * align  # the static bound
    assert len(set(dest.tolist())) == 41 and dest.max().item() < offs[-1].item() <= n_rows
    starts = [0] + offs[:-1].tolist()
    for e, (start, end) in enumerate(zip(starts, offs.tolist(), strict=True)):
        mine = (pair_expert == e).nonzero().flatten()
        assert start % align == 0 and end - start == -(-len(mine) // align) * align
        # The group's first rows hold its pairs, in pair order; the rest is padding.
        assert dest[mine].tolist() == list(range(start, start + len(mine)))
    # src inverts dest: each pair's row names the pair; every other row names none.
    want_src = [-1] * n_rows
    for pair, row in enumerate(dest.tolist()):
        want_src[row] = pair
    assert src.tolist() == want_src


def test_valid_mask_does_not_change_output():
    moe = _small_moe(n_shared=1, seed=4)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    assert torch.equal(moe(x), moe(x, valid))


def test_init_weights_initialises_every_expert():
    torch.manual_seed(5)
    init_std, out_init_std = 0.02, 0.01
    moe = LatentMoE(
        dim=64, n_experts=8, top_k=2, n_shared=1, latent_dim=32, expert_hidden=48, shared_hidden=40
    )
    for p in moe.parameters():
        p.data.fill_(float("nan"))
    moe.router.expert_bias.fill_(1.0)
    moe.init_weights(init_std, out_init_std)
    w1, w3 = moe.experts.w13.chunk(2, dim=1)
    for w, std in ((w1, init_std), (w3, init_std), (moe.experts.w2, out_init_std)):
        for e in range(8):
            expert = w[e]
            assert torch.isfinite(expert).all()
            # ±3σ truncation and 1.5k samples: 15% covers it.
            assert math.isclose(expert.std().item(), std, rel_tol=0.15)
            for other in range(e):
                assert not torch.equal(expert, w[other])
    assert all(torch.isfinite(p).all() for p in moe.parameters())
    assert moe.router.weight.abs().max().item() > 0
    assert torch.equal(moe.norm.weight, torch.ones(32))
    assert torch.equal(moe.router.expert_bias, torch.zeros(8))


@scalar_cpp()  # one fullgraph trace and results against eager
def test_compiled_fullgraph_matches_eager_float32_forward_and_backward():
    """fullgraph=True: the whole layer (routing, dispatch, experts, combine) is one graph."""
    moe = _small_moe(n_shared=1, seed=6, dtype=torch.float32)
    x = torch.randn(2, 6, 12, requires_grad=True)
    params = [x, *moe.parameters()]

    def run(fn):
        out = fn(x)
        return [out, *torch.autograd.grad(out.square().sum(), params)]

    eager = run(moe)
    eager_hist = moe.router.qb_hist.clone()
    moe.router.reset_qb_stats()
    compiled = run(torch.compile(moe, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        scale = max(1.0, want.abs().max().item())
        assert (got - want).abs().max().item() <= COMPILE_TOL * scale
    # The compiled forward still feeds Quantile Balancing.
    assert torch.equal(moe.router.qb_hist, eager_hist)


CHUNK_TOL = 1e-6  # float32, relative to the largest magnitude (at least 1): seen 1.8e-7


def _chunked_pair(chunk: int, seed: int) -> tuple[LatentMoE, LatentMoE]:
    """The same float32 layer without and with token chunks."""
    plain = _small_moe(n_shared=1, seed=seed, dtype=torch.float32)
    chunked = _small_moe(n_shared=1, seed=seed, dtype=torch.float32)
    chunked.token_chunk = chunk
    return plain, chunked


def _step(moe, x: torch.Tensor, grad_out: torch.Tensor, valid=None,
          outer_ac: bool = False) -> list[torch.Tensor]:
    """A training forward+backward (under a full-AC checkpoint of the layer if outer_ac): the
    output, then the gradients of x and of every parameter."""
    params = [x, *(p for p in moe.parameters())]
    out = (checkpoint(moe, x, valid, use_reentrant=False) if outer_ac else moe(x, valid))
    return [out, *torch.autograd.grad((out * grad_out).sum(), params)]


def _assert_close_scaled(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = max(1.0, w.abs().max().item())
        assert (g - w).abs().max().item() <= tol * scale, i


@pytest.mark.parametrize("outer_ac", [False, True], ids=["plain", "in-full-ac"])
def test_token_chunks_match_unchunked_outputs_gradients_and_qb_stats(outer_ac: bool,
                                                                     monkeypatch):
    # 2 × 11 = 22 tokens in chunks of 8: two full chunks and one of 6.
    plain, chunked = _chunked_pair(chunk=8, seed=8)
    chunk_sizes = []

    def counted(fn, x, *args, **kwargs):
        chunk_sizes.append(x.shape[0])
        return checkpoint(fn, x, *args, **kwargs)

    monkeypatch.setattr(token_chunks, "checkpoint", counted)
    x = torch.randn(2, 11, 12, requires_grad=True)
    grad_out = torch.randn(2, 11, 12)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 7:] = False  # padding, excluded from the statistics in every chunk
    want = _step(plain, x, grad_out, valid)
    got = _step(chunked, x, grad_out, valid, outer_ac)
    # The outer checkpoint re-runs the layer's forward (its chunks' checkpoints) in backward.
    assert chunk_sizes == [8, 8, 6] * (2 if outer_ac else 1)
    _assert_close_scaled(got, want, CHUNK_TOL)
    assert all(g.abs().max().item() > 0 for g in got[1:])
    # Counted once per valid token: the chunks' and the outer checkpoint's recomputes are not.
    assert torch.equal(chunked.router.qb_hist, plain.router.qb_hist)
    assert torch.equal(chunked.router.expert_load, plain.router.expert_load)
    assert chunked.router.expert_load.sum().item() == valid.sum().item() * plain.top_k


@scalar_cpp()  # one fullgraph trace and results against eager
def test_token_chunks_compile_fullgraph_and_match_eager_in_full_ac():
    """The chunk checkpoints trace as HOPs inside one graph; around it an eager full-AC
    checkpoint re-runs the compiled forward in backward, as the trainer does."""
    # A fresh compile: LatentMoE.forward compiled earlier at other shapes (another test) would
    # recompile here with dynamic shapes, which Dynamo cannot lift into the chunk checkpoints'
    # subgraphs (torch 2.13, "lift_tracked_freevar_to_input ... root SubgraphTracer").
    torch._dynamo.reset()
    eager, compiled = _chunked_pair(chunk=8, seed=9)
    x = torch.randn(2, 7, 12, requires_grad=True)  # chunks of 8 and 6
    grad_out = torch.randn(2, 7, 12)
    want = _step(eager, x, grad_out)
    got = _step(torch.compile(compiled, fullgraph=True), x, grad_out, outer_ac=True)
    _assert_close_scaled(got, want, COMPILE_TOL)
    assert torch.equal(compiled.router.qb_hist, eager.router.qb_hist)
    assert torch.equal(compiled.router.expert_load, eager.router.expert_load)


def test_token_chunk_is_validated():
    with pytest.raises(ValueError, match="token_chunk"):
        LatentMoE(dim=8, n_experts=4, top_k=2, n_shared=0, latent_dim=4, expert_hidden=4,
                  shared_hidden=4, token_chunk=-1)
