"""qb_route: the PyTorch reference against a per-token loop, and the Triton op (run by Triton's
CPU interpreter in a child process, see tests/ops/interpreter.py for why) against the
reference.

Op vs reference is exact: ids, weights (their bits), histogram and load must be equal. The two
compute σ with different exp functions on CPU (NumPy's in the interpreter, torch's in the
reference), so test logits are drawn from values where the two σ agree bit for bit; ties come
from repeating values within a row and in the bias. The gradient w.r.t. the logits (PyTorch in
both, summed in different orders) is compared as relative RMS error, bound FP32_GRAD_RTOL.
"""

import importlib
import json
import math

import numpy as np
import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

from bench.triton_static import recorded_launches, source
from tests.ops.interpreter import guarded
from titan_moe.ops.router import qb_route, qb_route_naive
from titan_moe.ops.router.histogram import qb_range

FP32_GRAD_RTOL = 1e-6
LOOP_WEIGHT_TOL = {torch.float32: 1e-6, torch.float64: 1e-14}  # vs the loop in Python floats

# name -> (T, E, k, route_scale, n_bins, logits kind, with valid mask, with histogram, dtype)
CASES = {
    "T37-E12-k3-valid": (37, 12, 3, 1.5, 50, "random", True, True, torch.float32),
    "ties-T40-E10-k4": (40, 10, 4, 1.0, 1000, "ties", False, True, torch.float32),
    "E300-k16-T9": (9, 300, 16, 1.0, 1000, "random", True, True, torch.float32),
    "E64-k8-T130-bf16": (130, 64, 8, 2.0, 1000, "random", False, True, torch.bfloat16),
    "no-histogram": (19, 12, 2, 1.0, 1000, "random", True, False, torch.float32),
    # Every bias above (below) 0, E short of a power of two: the kernel's range ignores the
    # padding columns of its row block, where a 0 would set min(b) (max(b)).
    "bias-above-0-E300": (9, 300, 16, 1.0, 1000, "bias+", True, True, torch.float32),
    "bias-below-0-E300": (9, 300, 16, 1.0, 1000, "bias-", True, True, torch.float32),
}


def sigmoid_agreeing_values(dtype: torch.dtype) -> torch.Tensor:
    """Logit values in [-6, 6] (exact in dtype) whose torch σ equals 1 / (1 + np.exp(-x))."""
    grid = torch.linspace(-6, 6, 4097).to(dtype).unique().float()
    ours = torch.from_numpy(np.float32(1) / (np.float32(1) + np.exp(-grid.numpy())))
    return grid[torch.sigmoid(grid) == ours]


def make_inputs(n_tokens, n_experts, kind, with_valid, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = sigmoid_agreeing_values(dtype)
    if kind == "ties":
        pool = pool[torch.randperm(len(pool), generator=gen)[:4]]  # four levels: rows of ties
    logits = pool[torch.randint(len(pool), (n_tokens, n_experts), generator=gen)].to(dtype)
    bias = 0.1 * torch.randn(n_experts, generator=gen)
    if kind in ("bias+", "bias-"):
        bias = bias.abs() + 0.5 if kind == "bias+" else -bias.abs() - 0.5
    if kind == "ties":
        bias = bias[torch.arange(n_experts) % 3]  # equal bias for experts 0, 3, 6, ...
    valid = torch.rand(n_tokens, generator=gen) > 0.3 if with_valid else None
    return logits, bias, valid


# The cases the direct eager call (qb_route_call: the op's body without the dispatcher, see
# titan_moe.ops.direct_call) also runs: it shares the op's body and gradient, so two cases, fp32
# and bf16, check the wiring.
DIRECT_CASES = ("T37-E12-k3-valid", "E64-k8-T130-bf16")


def run_case(n_tokens, n_experts, k, route_scale, n_bins, kind, with_valid, with_hist, dtype,
             path="op"):
    from titan_moe.ops.router import qb_route_call, qb_route_triton

    logits, bias, valid = make_inputs(n_tokens, n_experts, kind, with_valid, dtype)
    want = qb_route_naive(logits.requires_grad_(), bias, k, route_scale, n_bins, valid, with_hist)
    ours = logits.detach().clone().requires_grad_()
    op = qb_route_triton if path == "op" else qb_route_call
    got = op(ours, bias, valid, k, route_scale, n_bins, with_hist)
    report = {name: bool(torch.equal(g.detach(), w.detach().to(g.dtype)))
              for name, g, w in zip(("ids", "weights", "hist", "load"), got, want, strict=True)}
    report["shapes"] = [list(t.shape) for t in got] == [list(t.shape) for t in want]
    report["weights_fp32"] = got[1].dtype == torch.float32
    grad_out = torch.randn(n_tokens, k, generator=torch.Generator().manual_seed(1))
    (want_grad,) = torch.autograd.grad((want[1] * grad_out).sum(), logits)
    (got_grad,) = torch.autograd.grad((got[1] * grad_out).sum(), ours)
    report["grad_dtype_ok"] = got_grad.dtype == dtype
    report["node_of_path"] = ("_direct" in type(got[1].grad_fn).__name__) == (path == "direct")
    report["grad_rel"] = ((got_grad.double() - want_grad.double()).norm()
                          / want_grad.double().norm()).item()
    return report


def run_launch_shapes() -> dict:
    """Every (BLOCK_T, num_warps) gives the reference's bits, as bench/qb_route.py assumes when it
    times one against another: rows split over programs (partial last program) and over warps."""
    from titan_moe.ops.router.qb_route_triton import launch_qb_route

    # 9 rows: each BLOCK_T above but 1 leaves its last program partial.
    logits, bias, valid = make_inputs(9, 300, "ties", True, torch.float32)
    want = qb_route_naive(logits, bias, 16, 1.0, 1000, valid)
    report = {}
    for block_t, num_warps in ((1, 1), (4, 1), (2, 4), (8, 8)):
        got = launch_qb_route(logits, bias, valid, 16, 1.0, 1000, True, (block_t, num_warps))
        report[f"{block_t}x{num_warps}"] = all(
            torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return report


def crowded_lane_logits(n_tokens: int, n_experts: int, k: int) -> torch.Tensor:
    """Rows whose k + 1 largest logits all lie in lane 0's columns (column // 4 % 32 == 0: the
    columns one lane loads in the kernel's row block) or, every other row, in the columns
    32 x 4 apart from each other across lanes 0 and 1: a lane then holds more than 4 of the top
    k + 1, so those rows must be picked again over every key."""
    gen = torch.Generator().manual_seed(2)
    pool = sigmoid_agreeing_values(torch.float32)
    logits = pool[torch.randint(len(pool) // 2, (n_tokens, n_experts), generator=gen)]
    lane0 = [c for c in range(n_experts) if c // 4 % 32 == 0]
    lanes01 = [c for c in range(n_experts) if c // 4 % 32 in (0, 1)]
    top = pool[-(k + 1):]  # distinct values above every other logit
    for t in range(n_tokens):
        cols = (lane0 if t % 2 else lanes01)[: k + 1]
        logits[t, cols] = top[torch.randperm(k + 1, generator=gen)]
    return logits


def run_lane_top4() -> dict:
    """Picking among each lane's 4 largest keys first gives the reference's bits: on random rows
    (where that is exact in nearly every row), on rows where one or two lanes hold the whole top
    k + 1 (picked again over every key), and on rows of ties (every row picked again)."""
    from titan_moe.ops.router.qb_route_triton import launch_qb_route

    random_logits, bias, valid = make_inputs(13, 300, "random", True, torch.float32)
    ties_logits, ties_bias, _ = make_inputs(9, 600, "ties", False, torch.float32)
    inputs = {"random-E300": (random_logits, bias, valid, 16),
              "random-E896": (*make_inputs(12, 896, "random", False, torch.float32)[:2], None,
                              16),
              "crowded-E896": (crowded_lane_logits(10, 896, 16), torch.zeros(896), None, 16),
              "ties-E600": (ties_logits, ties_bias, None, 8)}
    report = {}
    for name, (logits, b, v, k) in inputs.items():
        want = qb_route_naive(logits, b, k, 1.0, 1000, v)
        got = launch_qb_route(logits, b, v, k, 1.0, 1000, True, lane_top4=True)
        report[name] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return report

def run_shared_counting() -> dict:
    """The kernel writing each token's cutoff for `count_bins` (counting "shared") gives the
    reference's four outputs bit for bit: on CPU count_bins is its qb_histogram reference, so
    this checks the cutoffs the kernel writes, NaN for the tokens not counted included."""
    from titan_moe.ops.router.qb_route_triton import launch_qb_route

    report = {}
    for name, (n_tokens, n_experts, k, scale, n_bins, kind, with_valid, _, dtype) in CASES.items():
        logits, bias, valid = make_inputs(n_tokens, n_experts, kind, with_valid, dtype)
        want = qb_route_naive(logits, bias, k, scale, n_bins, valid)
        got = launch_qb_route(logits, bias, valid, k, scale, n_bins, True, counting="shared")
        report[name] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return report


# name -> (T, E, k, dtype of the routed logits): partial row blocks (BLOCK_T 16) and column
# blocks (128), k not a power of two, and a bf16 gradient (cast after the kernel).
WEIGHTS_GRAD_CASES = {
    "T37-E300-k16": (37, 300, 16, torch.float32),
    "T19-E12-k3": (19, 12, 3, torch.float32),
    "T33-E64-k8-bf16": (33, 64, 8, torch.bfloat16),
}
BF16_GRAD_RTOL = 4e-3  # one bf16 rounding (to nearest) of each gradient element


def weights_grad_formula(ids, routed_logits, g, route_scale, n_experts) -> torch.Tensor:
    """∂L/∂logits in float64 from the closed form (route_weights_grad_triton.py has the maths)."""
    s = torch.sigmoid(routed_logits.double())
    total = s.sum(-1, keepdim=True)
    g = g.double()
    grad_s = route_scale / total * (g - (g * s).sum(-1, keepdim=True) / total)
    return torch.zeros(ids.shape[0], n_experts, dtype=torch.float64).scatter_(
        -1, ids, grad_s * s * (1 - s))


def run_weights_grad(n_tokens, n_experts, k, dtype) -> dict:
    """route_weights_grad (interpreted, through its op and its direct call) against the float64
    closed form: relative RMS error, whether every unrouted element is exactly 0, and whether a
    gradient constant over each row (a power of two) gives exactly 0 everywhere, as the closed
    form does in IEEE arithmetic (the weights sum to ρ in every row)."""
    from titan_moe.ops.router import route_weights_grad_call, route_weights_grad_triton

    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(n_tokens)])
    routed_logits = (torch.randn(n_tokens, k, generator=gen) * 3).to(dtype)
    g = torch.randn(n_tokens, k, generator=gen)
    want = weights_grad_formula(ids, routed_logits, g, 1.5, n_experts)
    unrouted = torch.ones(n_tokens, n_experts, dtype=torch.bool).scatter_(-1, ids, False)
    row_constant = 2.0 ** torch.randint(-3, 4, (n_tokens, 1), generator=gen).expand(-1, k)
    report = {}
    for path, op in (("op", route_weights_grad_triton), ("direct", route_weights_grad_call)):
        got = op(ids, routed_logits, g, 1.5, n_experts)
        report[path] = {"dtype_ok": got.dtype == dtype,
                        "unrouted_zero": bool((got[unrouted] == 0).all()),
                        "row_constant_zero": bool((op(ids, routed_logits, row_constant, 1.5,
                                                      n_experts) == 0).all()),
                        "rel": ((got.double() - want).norm() / want.norm()).item()}
    return report


def run_opcheck() -> dict:
    from titan_moe.ops.router import qb_route_triton

    logits, bias, valid = make_inputs(9, 6, "random", True, torch.float32)
    checks = torch.library.opcheck(
        qb_route_triton, (logits.requires_grad_(), bias, valid, 2, 1.0, 1000, True),
        test_utils=("test_schema", "test_autograd_registration"),
    )  # fmt: skip
    from titan_moe.ops.router import route_weights_grad_triton

    ids = torch.tensor([[0, 3], [5, 1], [2, 4]])
    grad_checks = torch.library.opcheck(
        route_weights_grad_triton, (ids, torch.randn(3, 2), torch.randn(3, 2), 1.0, 6),
        test_utils=("test_schema",))
    return {name: str(outcome) for name, outcome in checks.items()} | {
        f"weights_grad_{name}": str(outcome) for name, outcome in grad_checks.items()}


@pytest.mark.parametrize("name", CASES)
def test_op_equals_reference_under_interpreter(results, name):
    equal = {key: value for key, value in results[name].items() if key != "grad_rel"}
    assert equal.get("error") is None and all(equal.values()), equal
    assert results[name]["grad_rel"] <= FP32_GRAD_RTOL


@pytest.mark.parametrize("name", DIRECT_CASES)
def test_direct_call_equals_reference_under_interpreter(results, name):
    report = results[f"{name}-direct"]
    equal = {key: value for key, value in report.items() if key != "grad_rel"}
    assert equal.get("error") is None and all(equal.values()), equal
    assert report["grad_rel"] <= FP32_GRAD_RTOL


@pytest.mark.parametrize("name", WEIGHTS_GRAD_CASES)
def test_weights_grad_kernel_matches_float64_formula_under_interpreter(results, name):
    report = results[f"weights-grad-{name}"]
    assert "error" not in report, report["error"]
    bound = BF16_GRAD_RTOL if WEIGHTS_GRAD_CASES[name][3] == torch.bfloat16 else FP32_GRAD_RTOL
    for path in ("op", "direct"):
        assert report[path]["dtype_ok"] and report[path]["unrouted_zero"], report
        assert report[path]["row_constant_zero"], report
        assert report[path]["rel"] <= bound, report


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def test_shared_counting_gives_the_same_bits(results):
    assert results["shared_counting"] == dict.fromkeys(CASES, True)


def test_lane_top4_gives_the_same_bits(results):
    assert results["lane_top4"] == {"random-E300": True, "random-E896": True,
                                    "crowded-E896": True, "ties-E600": True}


def test_launch_shapes_give_the_same_bits(results):
    assert results["launch_shapes"] == {"1x1": True, "4x1": True, "2x4": True, "8x8": True}


def _loop_reference(logits, bias, k, route_scale, n_bins, valid):
    """Token by token in Python floats: sorted top-(k+1), weights, cutoffs; bins via the spec."""
    scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    n_experts = logits.shape[-1]
    lo, hi = qb_range(bias)
    hist = torch.zeros(n_experts, n_bins, dtype=torch.int32)
    load = torch.zeros(n_experts, dtype=torch.int32)
    ids, weights = [], []
    for t, row in enumerate(scores.tolist()):
        biased = [s + b for s, b in zip(row, bias.to(scores.dtype).tolist(), strict=True)]
        order = sorted(range(n_experts), key=lambda e: (-biased[e], e))
        chosen = order[:k]
        ids.append(chosen)
        weights.append([row[e] / sum(row[j] for j in chosen) * route_scale for e in chosen])
        if valid is None or valid[t]:
            alpha = torch.tensor(biased[order[k]], dtype=torch.float32)
            r = alpha - scores[t].float()
            bins = ((r - lo) * (n_bins / (hi - lo))).floor().clamp(0, n_bins - 1).long()
            for e in range(n_experts):
                hist[e, bins[e]] += 1
            for e in chosen:
                load[e] += 1
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64), hist, load


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_reference_matches_per_token_loop(kind, dtype):
    logits, bias, valid = make_inputs(45, 11, kind, True, torch.float32, seed=2)
    logits = logits.to(dtype)
    ids, weights, hist, load = qb_route(logits, bias, 4, 1.3, 64, valid)
    want_ids, want_weights, want_hist, want_load = _loop_reference(logits, bias, 4, 1.3, 64, valid)
    assert torch.equal(ids, want_ids)
    assert (weights.double() - want_weights).abs().max().item() <= LOOP_WEIGHT_TOL[dtype]
    assert torch.equal(hist, want_hist) and torch.equal(load, want_load)
    assert hist.sum().item() == int(valid.sum()) * 11


def test_reference_weight_gradient_matches_formula():
    """p_j = ρ s_j / S: the reference's autograd against the closed form, in float64."""
    logits, bias, _ = make_inputs(8, 7, "random", False, torch.float32, seed=3)
    logits = logits.double().requires_grad_()
    ids, weights, _, _ = qb_route(logits, bias, 3, 0.7, with_histogram=False)
    g = torch.randn(8, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((weights * g).sum(), logits)
    want = weights_grad_formula(ids, logits.detach().gather(-1, ids), g, 0.7, 7)
    assert (grad - want).abs().max().item() <= 1e-15
    assert math.isclose(weights.sum(-1).mean().item(), 0.7, rel_tol=1e-14)


ROUTER_LAUNCHES = {
    "route-E16-k2": ("qb_route_triton", lambda m: m.qb_route_triton(
        torch.randn(64, 16), torch.zeros(16), None, 2, 1.0, 32, True)),
    "route-E896-k16-lane-top4": ("qb_route_triton", lambda m: m.qb_route_triton(
        torch.randn(64, 896), torch.zeros(896), torch.ones(64, dtype=torch.bool), 16, 2.5, 1000,
        True)),
    "weights-grad-E64-k8": ("route_weights_grad_triton", lambda m: m._route_weights_grad(
        torch.arange(16).view(2, 8), torch.randn(2, 8), torch.randn(2, 8), 2.5, 64)),
}


@pytest.mark.parametrize("case", ROUTER_LAUNCHES)
def test_router_kernels_divide_with_ieee_rounding_on_cuda(case):
    """Each launch compiled for sm_90 on the CPU host divides with div.rn.f32 only. Triton's
    fp32 `/` is div.full.f32 (up to 2 ulp): it would break the weights' bit-equality with the
    reference, and leave noise where the exact gradient is 0 (a row-constant weight gradient;
    tests/gpu/test_router_cuda.py checks those zeros on CUDA), which the interpreter, dividing
    with NumPy, cannot show. The weight-gradient kernel had two such divisions before d6e9954."""
    name, call = ROUTER_LAUNCHES[case]
    module = importlib.import_module(f"titan_moe.ops.router.{name}")
    launches = recorded_launches(module, lambda: call(module))
    assert launches
    for kernel, _, args, kwargs in launches:
        # Recorded on CPU tensors; compile what CUDA runs (libdevice's expf, as torch.sigmoid).
        src, options = source(kernel, args, {**kwargs, "LIBDEVICE": True})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        counts = {op: ptx.count(op) for op in ("div.rn.f32", "div.full.f32", "div.approx.f32",
                                               "rcp.approx")}
        assert counts.pop("div.rn.f32") and not any(counts.values()), (kernel.fn.__name__,
                                                                        counts)


@pytest.mark.parametrize(
    ("shape", "bias_shape", "k", "valid_shape", "field"),
    [((4, 6, 1), (6,), 2, None, "logits"), ((4, 6), (5,), 2, None, "bias"),
     ((4, 6), (6,), 6, None, "top_k"), ((4, 6), (6,), 2, (3,), "valid")],
)
def test_bad_inputs_name_the_field(shape, bias_shape, k, valid_shape, field):
    valid = None if valid_shape is None else torch.ones(valid_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=field):
        qb_route(torch.zeros(shape), torch.zeros(bias_shape), k, valid=valid)


def test_lane_top4_on_short_rows_names_the_field():
    from titan_moe.ops.router.qb_route_triton import launch_qb_route

    with pytest.raises(ValueError, match="lane_top4"):
        launch_qb_route(torch.zeros(4, 64), torch.zeros(64), None, 2, 1.0, 1000, True,
                        lane_top4=True)


@pytest.mark.parametrize(("counting", "n_bins"), [("sorted", 1000), ("shared", 2**15)])
def test_bad_counting_names_the_field(counting, n_bins):
    from titan_moe.ops.router.qb_route_triton import launch_qb_route

    with pytest.raises(ValueError, match="counting"):
        launch_qb_route(torch.zeros(4, 6), torch.zeros(6), None, 2, 1.0, n_bins, True,
                        counting=counting)


if __name__ == "__main__":
    reports = {name: guarded(run_case, *case) for name, case in CASES.items()}
    reports |= {f"{name}-direct": guarded(run_case, *CASES[name], "direct")
                for name in DIRECT_CASES}
    reports |= {f"weights-grad-{name}": guarded(run_weights_grad, *case)
                for name, case in WEIGHTS_GRAD_CASES.items()}
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck),
                      "launch_shapes": guarded(run_launch_shapes),
                      "shared_counting": guarded(run_shared_counting),
                      "lane_top4": guarded(run_lane_top4)}))
