import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.ops.fp32_histogram import fp32_histogram
from titan_moe.model.moe import LatentMoE
from titan_moe.model.quantile_balance import QuantileBalancer, qb_bias_exact, qb_bias_from_histogram
from titan_moe.model.router import Router
from titan_moe.ops.router.histogram import qb_histogram, qb_range
from titan_moe.train.optimizer import all_reduce_qb_stats

# The histogram is binned in fp32 while the exact reference runs in float64: a value sitting on
# a bin edge may land one bin over, so the one-bin bound gets this much slack.
FP32_EDGE_SLACK = 1e-6


def _skewed_scores(n_tokens: int, n_experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(n_experts, generator=gen)
    offset[:2] += 3.0
    logits = torch.randn(n_tokens, n_experts, generator=gen, dtype=torch.float64) + offset
    return torch.sigmoid(logits)


def _cutoff(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    return (scores + bias).topk(top_k + 1, dim=-1).values[:, top_k]


def _naive_exact_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Python sorts: alpha_t = (k+1)-th largest biased score, b_e = (q+1)-th smallest r[:, e]."""
    n_tokens, n_experts = scores.shape
    rows = scores.tolist()
    b = bias.tolist()
    alpha = [
        sorted((s + bb for s, bb in zip(row, b, strict=True)), reverse=True)[top_k] for row in rows
    ]
    q = n_tokens * top_k // n_experts
    new = [sorted(alpha[t] - rows[t][e] for t in range(n_tokens))[q] for e in range(n_experts)]
    new = torch.tensor(new, dtype=torch.float64)
    return new - new.mean()


def test_exact_bias_matches_naive_sorts_and_balances():
    n_tokens, n_experts, top_k = 300, 12, 3
    scores = _skewed_scores(n_tokens, n_experts, seed=0)
    bias = torch.randn(n_experts, dtype=torch.float64) * 0.2
    got = qb_bias_exact(scores, bias, top_k)
    torch.testing.assert_close(got, _naive_exact_bias(scores, bias, top_k), rtol=0, atol=1e-12)
    # b_e is the (q+1)-th smallest r[:, e]: at most q tokens lie below it, at least q+1 at or
    # below (r ties at the old b_e: for a token's (k+1)-th expert r = alpha - s_e = b_e).
    raw = qb_bias_exact(scores, bias, top_k, centre=False)
    r = _cutoff(scores, bias, top_k)[:, None] - scores
    q = n_tokens * top_k // n_experts
    assert ((r < raw).sum(0) <= q).all() and ((r <= raw).sum(0) >= q + 1).all()


@pytest.mark.parametrize("n_bins", [1000, 40])
def test_histogram_bias_within_one_bin_of_exact(n_bins: int):
    n_tokens, n_experts, top_k = 4000, 16, 2
    scores = _skewed_scores(n_tokens, n_experts, seed=1).float()
    bias = torch.randn(n_experts) * 0.3
    hist = qb_histogram(scores, _cutoff(scores, bias, top_k), bias, n_bins)
    assert hist.dtype == torch.int32 and hist.shape == (n_experts, n_bins)
    assert (hist.sum(-1) == n_tokens).all()
    lo, hi = qb_range(bias)
    bin_width = (hi - lo).item() / n_bins
    from_hist = qb_bias_from_histogram(hist, lo, hi, top_k, centre=False)
    exact = qb_bias_exact(scores, bias, top_k, centre=False)
    assert (from_hist - exact).abs().max().item() <= bin_width + FP32_EDGE_SLACK
    # Centring subtracts each side's mean, so centred values agree within two bin widths.
    centred = qb_bias_from_histogram(hist, lo, hi, top_k) - qb_bias_exact(scores, bias, top_k)
    assert centred.abs().max().item() <= 2 * bin_width + FP32_EDGE_SLACK
    assert abs(qb_bias_from_histogram(hist, lo, hi, top_k).mean().item()) < 1e-6


def test_padding_is_excluded():
    n_tokens, n_pad, n_experts, top_k = 500, 77, 8, 2
    scores = _skewed_scores(n_tokens + n_pad, n_experts, seed=2).float()
    scores[n_tokens:] = torch.rand(n_pad, n_experts)  # padding rows hold anything
    bias = torch.randn(n_experts) * 0.1
    valid = torch.arange(n_tokens + n_pad) < n_tokens
    cutoff = _cutoff(scores, bias, top_k)
    padded = qb_histogram(scores, cutoff, bias, valid=valid)
    real = qb_histogram(scores[:n_tokens], cutoff[:n_tokens], bias)
    assert torch.equal(padded, real)
    assert torch.equal(
        qb_bias_exact(scores, bias, top_k, valid=valid),
        qb_bias_exact(scores[:n_tokens], bias, top_k),
    )


def test_nan_scores_fall_into_the_first_bin():
    # A diverged step's NaN scores must not become an out-of-range scatter index (the trainer
    # skips that step and drops its histogram).
    scores = torch.tensor([[0.2, float("nan"), 0.7], [float("nan")] * 3])
    hist = qb_histogram(scores, torch.tensor([0.5, float("nan")]), torch.zeros(3), n_bins=10)
    assert hist[:, 0].tolist() == [1, 2, 1] and hist.sum() == 6


def test_bins_equal_an_fp32_loop_with_one_division():
    """Each (token, expert) bin against NumPy's fp32 arithmetic (IEEE: the range, one division
    for n_bins / (hi - lo), r - lo, the product, floor), exact. This bias makes 1000 / (hi - lo)
    one ulp off when computed as a reciprocal times 1000 (Tensor.__rtruediv__): 132 of its
    8,000 counts moved then at 200,000 tokens, 20 at the 20,000 here."""
    bias = torch.tensor([-0.13360487, 0.08870961, 0.07679575, 0.0057113, 0.02239584, 0.05519643,
                         -0.0578798, 0.00177221])
    lo, hi = qb_range(bias)
    assert torch.full_like(hi, 1000) / (hi - lo) != 1000 / (hi - lo)  # the case this guards
    scores = torch.sigmoid(2 * torch.randn(20000, 8, generator=torch.Generator().manual_seed(1)))
    cutoff = torch.topk(scores + bias, 3).values[:, 2]
    want = fp32_histogram(scores.numpy(), cutoff.numpy(), bias.numpy(), 1000)
    assert np.array_equal(qb_histogram(scores, cutoff, bias, 1000).numpy(), want)


def _router_counts(router: Router) -> tuple[int, int]:
    return int(router.qb_hist.sum()), int(router.expert_load.sum())


def test_router_accumulates_only_in_training_forwards():
    torch.manual_seed(3)
    n_tokens, n_experts, top_k = 20, 6, 2
    router = Router(dim=8, n_experts=n_experts, top_k=top_k)
    router.init_weights(init_std=0.5)
    x = torch.randn(n_tokens, 8)
    valid = torch.arange(n_tokens) < 15
    router(x, valid)
    assert _router_counts(router) == (15 * n_experts, 15 * top_k)
    router.eval()
    router(x)
    assert _router_counts(router) == (15 * n_experts, 15 * top_k)


@pytest.mark.parametrize(
    ("compiled", "reentrant"),
    [(False, False), (False, True), (True, False)],
    ids=["eager", "eager_reentrant", "compiled_inside"],
)
def test_no_accumulation_in_checkpoint_recompute(compiled: bool, reentrant: bool):
    torch.manual_seed(4)
    moe = LatentMoE(
        dim=16, n_experts=6, top_k=2, n_shared=1, latent_dim=8, expert_hidden=12, shared_hidden=10
    )
    moe.init_weights(init_std=0.2, out_init_std=0.1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    # aot_eager traces with dynamo like inductor does, so a trace-time recompute check would
    # be folded away here just the same; it compiles in a fraction of the time.
    layer = torch.compile(moe, backend="aot_eager", fullgraph=True) if compiled else moe
    # A plain training forward gives the expected counts. It also compiles outside the
    # checkpoint: on a CUDA machine compiling initialises the device, which checkpoint forbids.
    layer(x)
    expected = _router_counts(moe.router)
    assert expected == (10 * 6, 10 * 2)
    moe.router.reset_qb_stats()
    out = checkpoint(layer, x, use_reentrant=reentrant)
    assert _router_counts(moe.router) == expected
    out.square().sum().backward()
    assert x.grad is not None and moe.router.weight.grad is not None
    assert _router_counts(moe.router) == expected


def _two_layer_model(n_experts: int, top_k: int) -> torch.nn.ModuleList:
    torch.manual_seed(5)
    moes = torch.nn.ModuleList(
        LatentMoE(
            dim=16,
            n_experts=n_experts,
            top_k=top_k,
            n_shared=0,
            latent_dim=8,
            expert_hidden=12,
            shared_hidden=0,
            layer_id=layer_id,
        )
        for layer_id in (1, 3)
    )
    for moe in moes:
        moe.init_weights(init_std=0.3, out_init_std=0.1)
        moe.router.expert_bias.copy_(torch.randn(n_experts) * 0.05)
    return moes


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(6)
    batches = []
    for n_valid in (14, 9, 11):
        valid = (torch.arange(14) < n_valid).view(2, 7)
        batches.append((torch.randn(2, 7, 16, generator=gen), valid))
    return batches


def test_balancer_step_updates_bias_and_reports_load():
    n_experts, top_k = 8, 2
    moes = _two_layer_model(n_experts, top_k)
    balancer = QuantileBalancer(moes)
    assert balancer.layer_ids == [1, 3]
    batches = _micro_batches()
    expected_bias, expected_load = [], []
    for moe in moes:
        router, hist, load = moe.router, 0, torch.zeros(n_experts, dtype=torch.float64)
        for x, valid in batches:
            moe(x, valid)
            # Independent bookkeeping: recompute each micro-batch's scores and count by hand.
            x_flat, valid_flat = x.view(-1, 16), valid.view(-1)
            scores = torch.sigmoid(torch.nn.functional.linear(x_flat, router.weight))
            biased = scores + router.expert_bias
            hist = hist + qb_histogram(
                scores,
                _cutoff(scores, router.expert_bias, top_k),
                router.expert_bias,
                valid=valid_flat,
            )
            for t in range(x_flat.shape[0]):
                if valid_flat[t]:
                    for e in biased[t].topk(top_k).indices.tolist():
                        load[e] += 1
        lo, hi = qb_range(router.expert_bias)
        expected_bias.append(qb_bias_from_histogram(hist, lo, hi, top_k))
        expected_load.append(load)
    assert balancer.metrics() == {}  # no step yet
    balancer.step()
    metrics = balancer.metrics()
    for i, layer_id in enumerate((1, 3)):
        router, load = moes[i].router, expected_load[i]
        assert metrics[f"moe/layer{layer_id}/max_violation"] == pytest.approx(
            (load.max() / load.mean() - 1).item(), rel=1e-12
        )
        torch.testing.assert_close(router.expert_bias, expected_bias[i], rtol=0, atol=1e-7)
        spread = (router.expert_bias.max() - router.expert_bias.min()).item()
        assert metrics[f"moe/layer{layer_id}/bias_spread"] == pytest.approx(spread, rel=1e-6)
        assert spread > 0
        torch.testing.assert_close(balancer.expert_load[i], load, rtol=0, atol=0)
        assert _router_counts(router) == (0, 0)
    mean_violation = (metrics["moe/layer1/max_violation"] + metrics["moe/layer3/max_violation"]) / 2
    assert metrics["moe/max_violation"] == pytest.approx(mean_violation, rel=1e-12)


@pytest.mark.parametrize("skip", [0.0, 1.0])
def test_balancer_step_with_a_skip_flag(skip: float):
    """Flag 0 is a plain step (same biases exactly); flag 1 keeps every bias as it was while the
    statistics are cleared and the loads still reported."""
    stepped = []
    for flag in (None, torch.tensor(skip)):
        moes = _two_layer_model(8, 2)
        before = [moe.router.expert_bias.clone() for moe in moes]
        balancer = QuantileBalancer(moes)
        for x, valid in _micro_batches():
            for moe in moes:
                moe(x, valid)
        balancer.step(flag)
        assert all(_router_counts(moe.router) == (0, 0) for moe in moes)
        assert balancer.expert_load.sum() > 0
        stepped.append([moe.router.expert_bias.clone() for moe in moes])
    plain, flagged = stepped
    for p, f, b in zip(plain, flagged, before, strict=True):
        assert not torch.equal(p, b)  # a plain step moves the bias
        torch.testing.assert_close(f, b if skip else p, rtol=0, atol=0)


def test_balancer_exact_mode_uses_kept_scores():
    n_experts, top_k = 8, 2
    moes = _two_layer_model(n_experts, top_k)
    balancer = QuantileBalancer(moes, exact=True)
    batches = _micro_batches()
    expected = []
    for moe in moes:
        router = moe.router
        x = torch.cat([x.view(-1, 16) for x, _ in batches])
        valid = torch.cat([valid.view(-1) for _, valid in batches])
        scores = torch.sigmoid(torch.nn.functional.linear(x, router.weight))
        expected.append(qb_bias_exact(scores, router.expert_bias, top_k, valid=valid))
        for x, valid in batches:
            moe(x, valid)
    balancer.step()
    for moe, bias in zip(moes, expected, strict=True):
        torch.testing.assert_close(moe.router.expert_bias, bias, rtol=0, atol=1e-6)
        assert moe.router.kept_scores == []


# Spec §6: E = 896, k = 16, 16K tokens per step, a strongly skewed sigmoid router.
SIM_EXPERTS, SIM_TOP_K, SIM_TOKENS = 896, 16, 16384
MAX_UPDATES = 5
BALANCED_VIOLATION = 0.5
FROZEN_MIN_VIOLATION = 10.0


def _max_violation(expert_ids: torch.Tensor) -> float:
    load = torch.zeros(SIM_EXPERTS).index_add_(
        0, expert_ids.flatten(), torch.ones(expert_ids.numel())
    )
    return (load.max() / load.mean() - 1).item()


def test_quantile_balancing_converges_on_skewed_router():
    gen = torch.Generator().manual_seed(7)
    # A few experts are hugely preferred: σ(4 + N) ≈ 0.98 against σ(N) ≈ 0.5 for the rest.
    offset = torch.randn(SIM_EXPERTS, generator=gen) * 0.5
    offset[:8] += 4.0
    bias, violations = torch.zeros(SIM_EXPERTS), []
    for step in range(MAX_UPDATES + 1):
        # Fresh tokens every step; the load is measured under the bias in force for the step.
        scores = torch.sigmoid(torch.randn(SIM_TOKENS, SIM_EXPERTS, generator=gen) + offset)
        top = (scores + bias).topk(SIM_TOP_K + 1, dim=-1)
        violations.append(_max_violation(top.indices[:, :SIM_TOP_K]))
        if step < MAX_UPDATES:
            lo, hi = qb_range(bias)
            hist = qb_histogram(scores, top.values[:, SIM_TOP_K], bias)
            bias = qb_bias_from_histogram(hist, lo, hi, SIM_TOP_K)
    # Step 0 runs with b = 0, which is what a frozen bias would give on every step.
    assert violations[0] > FROZEN_MIN_VIOLATION, violations
    assert violations[-1] < BALANCED_VIOLATION, violations


def _data_parallel_worker(rank: int, world_size: int, store_path: str, out_path: str) -> None:
    # One thread: the ranks share the CI machine's cores, and a forked child must not reuse the
    # parent's OpenMP pool.
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        moes = _two_layer_model(n_experts=8, top_k=2)
        balancer = QuantileBalancer(moes)
        for x, valid in _micro_batches()[rank::world_size]:
            for moe in moes:
                moe(x, valid)
        all_reduce_qb_stats(balancer.routers)
        balancer.step()
        metrics = balancer.metrics()
        torch.save({"bias": [m.router.expert_bias for m in moes], "metrics": metrics}, out_path)
    finally:
        torch.distributed.destroy_process_group()


def test_balancer_all_reduces_over_data_parallel_ranks(tmp_path):
    """Two gloo ranks, each seeing part of the tokens, reach the single-process bias exactly."""
    moes = _two_layer_model(n_experts=8, top_k=2)
    balancer = QuantileBalancer(moes)
    for x, valid in _micro_batches():
        for moe in moes:
            moe(x, valid)
    balancer.step()
    metrics = balancer.metrics()
    # Forked after the reference run, so the workers inherit everything it already loaded.
    world_size = 2
    outs = [str(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    context = torch.multiprocessing.get_context("fork")
    procs = [
        context.Process(
            target=_data_parallel_worker,
            args=(rank, world_size, str(tmp_path / "store"), outs[rank]),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    for out in outs:
        result = torch.load(out)
        for moe, bias in zip(moes, result["bias"], strict=True):
            assert torch.equal(moe.router.expert_bias, bias)
        assert result["metrics"] == pytest.approx(metrics, rel=1e-12)
