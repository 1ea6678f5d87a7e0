"""MoE dispatch and combine: the PyTorch reference against a pair-by-pair loop, and the Triton ops
(run by Triton's CPU interpreter in a child process, see tests/ops/interpreter.py) against the
reference in float64. The dispatch layout's Triton op (a counting sort) against the reference's
layout (a stable sort): integers, equal exactly (dest, src and offs, values and dtypes).

Op vs reference, as relative RMS error ||got − want|| / ||want||, the reference run in float64
on the op's inputs (already rounded to their dtypes) and the same output gradients:
  grouped (dispatch forward)  a copy: equal to the reference bit for bit, zeros included.
  u, dweights                 fp32 outputs summed in fp32: FP32_RTOL (observed ~1e-7).
  dz, dexpert_out             in the rows' dtype: fp32 FP32_RTOL; bf16 one rounding of each
                              element, truncated by the interpreter (about 3.1e-3 relative RMS,
                              see test_short_conv.py), bound BF16_RTOL = 5e-3.
dexpert_out must also be exactly zero on every row no pair takes (the grouped GEMMs' weight
gradients read the padding rows). The combine in out_dtype bf16 must be the fp32 combine
rounded once (to nearest on CUDA, bit for bit; the interpreter may truncate instead), and with
the bf16 gradient give exactly the gradients of the fp32 combine given that gradient widened
(the layer's u.to(bf16) that it replaces).
"""

import json

import pytest
import torch

import titan_moe.ops.moe_dispatch as dispatch_module
from tests.metrics import rel_rms
from tests.ops.interpreter import guarded
from titan_moe.ops.moe_dispatch import (
    dispatch_layout,
    dispatch_layout_naive,
    moe_combine,
    moe_combine_naive,
    moe_dispatch,
    moe_dispatch_naive,
)

FP32_RTOL = 1e-5
BF16_RTOL = 5e-3
LOOP_ATOL = 1e-12  # the reference against the pair loop, both float64

# name -> (tokens, top_k, experts, group alignment, width, rows' dtype)
CASES = {
    "k3-d20-align4": (7, 3, 5, 4, 20, torch.float32),
    "k2-d1100-align8": (5, 2, 3, 8, 1100, torch.float32),  # two column blocks of 1024
    "k8-d64-align8": (6, 8, 10, 8, 64, torch.float32),
    "bf16-k3-d40-align8": (9, 3, 4, 8, 40, torch.bfloat16),
}
# the combine in out_dtype bf16: bf16 rows, and fp32 rows over two column blocks
OUT_DTYPE_CASES = ("bf16-k3-d40-align8", "k2-d1100-align8")
# name -> (pairs, experts, group alignment, how the experts are drawn): E not a power of two;
# empty groups; every pair on one expert; no pairs; at E 4,100 two blocks of pairs, their counts
# summed one block a tile (the kernel's tile of counts holds one row of 8,192 experts). Each
# block of 1,024 pairs costs the interpreter about 3 s (its sort), so the cases are few and small.
LAYOUT_CASES = {
    "layout-p41-e6-align1": (41, 6, 1, "random"),
    "layout-p300-e100-align16": (300, 100, 16, "random"),
    "layout-p64-e5-one-expert": (64, 5, 8, "one"),
    "layout-p0-e4-align8": (0, 4, 8, "random"),
    "layout-p1500-e4100-align8": (1500, 4100, 8, "random"),
}
# The direct call runs the op's body as the op does: one case checks it.
LAYOUT_DIRECT_CASES = ("layout-p41-e6-align1",)


def make_inputs(n_tokens, top_k, n_experts, align, width, dtype, seed=0):
    """z [N, d] and expert_out [R, d] in dtype (expert_out's untaken rows hold NaN, as the
    grouped GEMM may leave them), weights [N, k] fp32, the layout, du [N, d] fp32 and dgrouped
    [R, d] in dtype."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k]
                           for _ in range(n_tokens)])
    dest, src, _ = dispatch_layout(experts.reshape(-1), n_experts, align)
    n_rows = src.numel()
    z = torch.randn(n_tokens, width, generator=gen).to(dtype)
    expert_out = torch.randn(n_rows, width, generator=gen).to(dtype)
    expert_out[src < 0] = float("nan")
    weights = torch.rand(n_tokens, top_k, generator=gen)
    du = torch.randn(n_tokens, width, generator=gen)
    dgrouped = torch.randn(n_rows, width, generator=gen).to(dtype)
    return z, expert_out, weights, dest, src, du, dgrouped


def compare_with_reference(dispatch, combine, tensors) -> dict:
    """dispatch(z, dest, src, k) and combine(rows, dest, src, weights) against the float64
    reference on make_inputs' tensors (any device): errors and checks."""
    z, expert_out, weights, dest, src, du, dgrouped = tensors
    top_k, dtype = weights.shape[1], z.dtype

    z64 = z.double().requires_grad_()
    want_grouped = moe_dispatch_naive(z64, dest, src.numel(), top_k)
    (want_dz,) = torch.autograd.grad(want_grouped, z64, dgrouped.double())
    zt = z.clone().requires_grad_()
    grouped = dispatch(zt, dest, src, top_k)
    (dz,) = torch.autograd.grad(grouped, zt, dgrouped)

    e64 = expert_out.double().nan_to_num().requires_grad_()
    w64 = weights.double().requires_grad_()
    want_u = moe_combine_naive(e64, dest, w64)
    want_de, want_dw = torch.autograd.grad(want_u, (e64, w64), du.double())
    et, wt = expert_out.clone().requires_grad_(), weights.clone().requires_grad_()
    u = combine(et, dest, src, wt)
    de, dw = torch.autograd.grad(u, (et, wt), du)
    return {
        "grouped_exact": bool(torch.equal(grouped, want_grouped.detach().to(dtype))),
        "dz": rel_rms(dz, want_dz), "u": rel_rms(u, want_u),
        "dexpert_out": rel_rms(de, want_de), "dweights": rel_rms(dw, want_dw),
        "untaken_grad_zero": bool((de[src < 0] == 0).all()),
        "dtypes_ok": (grouped.dtype, dz.dtype, u.dtype, de.dtype, dw.dtype)
        == (dtype, dtype, torch.float32, dtype, torch.float32),
    }


PATHS = ("op", "direct")


def ops_of(path: str) -> tuple:
    """(dispatch, combine, layout): the triton_ops, or their direct eager calls
    (titan_moe.ops.direct_call), each taking its inputs in full."""
    from titan_moe.ops import moe_dispatch as ops

    if path == "op":
        return ops.moe_dispatch_triton, ops.moe_combine_triton, ops.dispatch_layout_triton
    return (ops.moe_dispatch_call,
            lambda e, d, s, w, out_dtype=None: ops.moe_combine_call(e, d, s, w, out_dtype),
            ops.dispatch_layout_call)


def run_case(n_tokens, top_k, n_experts, align, width, dtype, path) -> dict:
    """The Triton ops (interpreted) against the float64 reference, and the autograd nodes of
    their outputs (the direct calls' own Functions, or the dispatcher's)."""
    dispatch, combine, _ = ops_of(path)
    nodes = []

    def noted(op):
        def call(*args):
            out = op(*args)
            nodes.append(type(out.grad_fn).__name__)
            return out
        return call

    report = compare_with_reference(noted(dispatch), noted(combine),
                                    make_inputs(n_tokens, top_k, n_experts, align, width, dtype))
    return {**report, "nodes": nodes}


def compare_out_dtype(combine, tensors) -> dict:
    """combine(..., out_dtype=bf16) against combine in fp32 then rounded (u_equal: to nearest;
    u_rounded_or_truncated: each element either that or the fp32 value truncated), and both
    gradients bit for bit (any device)."""
    _, expert_out, weights, dest, src, du, _ = tensors
    expert_out = expert_out.nan_to_num()
    du = du.to(torch.bfloat16)
    e32, w32 = expert_out.clone().requires_grad_(), weights.clone().requires_grad_()
    u32 = combine(e32, dest, src, w32)
    want = torch.autograd.grad(u32, (e32, w32), du.float())
    e16, w16 = expert_out.clone().requires_grad_(), weights.clone().requires_grad_()
    u16 = combine(e16, dest, src, w16, torch.bfloat16)
    got = torch.autograd.grad(u16, (e16, w16), du)
    nearest = u32.detach().to(torch.bfloat16)
    truncated = (u32.detach().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return {"u_dtype": str(u16.dtype), "u_equal": bool(torch.equal(u16, nearest)),
            "u_rounded_or_truncated": bool(((u16 == nearest) | (u16 == truncated)).all()),
            "grads_equal": [bool(torch.equal(g, w)) for g, w in zip(got, want, strict=True)]}


def run_out_dtype_case(n_tokens, top_k, n_experts, align, width, dtype, path) -> dict:
    return compare_out_dtype(ops_of(path)[1],
                             make_inputs(n_tokens, top_k, n_experts, align, width, dtype))


def layout_pairs(n_pairs: int, n_experts: int, draw: str, seed: int = 0) -> torch.Tensor:
    """Each pair's expert, int64: uniform with expert 2 left empty ("random"), or all 3."""
    gen = torch.Generator().manual_seed(seed)
    if draw == "one":
        return torch.full((n_pairs,), 3, dtype=torch.int64)
    pairs = torch.randint(n_experts, (n_pairs,), generator=gen)
    return torch.where(pairs == 2, 1, pairs)


def compare_layout(pair_expert: torch.Tensor, n_experts: int, align: int, layout_op=None) -> dict:
    """The Triton op (any device; by default the triton_op) against the reference's layout."""
    from titan_moe.ops.moe_dispatch import dispatch_layout_triton, layout_rows

    want = dispatch_layout_naive(pair_expert, n_experts, align)
    got = (layout_op or dispatch_layout_triton)(
        pair_expert, n_experts, align, layout_rows(pair_expert.numel(), n_experts, align))
    return {name: bool(g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()))
            for name, g, w in zip(("dest", "src", "offs"), got, want, strict=True)}


def run_layout_case(n_pairs, n_experts, align, draw, path) -> dict:
    return compare_layout(layout_pairs(n_pairs, n_experts, draw), n_experts, align,
                          ops_of(path)[2])


def run_opcheck() -> dict:
    """torch.library.opcheck of the four ops' schemas and the forwards' autograd registration
    (the fake-tensor check runs on the GPU: under the interpreter Triton touches fake storage)."""
    from titan_moe.ops.moe_dispatch import (
        moe_combine_bwd_triton,
        moe_combine_triton,
        moe_dispatch_bwd_triton,
        moe_dispatch_triton,
    )

    z, expert_out, weights, dest, src, du, dgrouped = make_inputs(5, 2, 3, 4, 16, torch.float32)
    expert_out = expert_out.nan_to_num()
    schema = ("test_schema",)
    both = ("test_schema", "test_autograd_registration")
    checks = {
        "dispatch": torch.library.opcheck(moe_dispatch_triton,
                                          (z.requires_grad_(), dest, src, 2), test_utils=both),
        "combine": torch.library.opcheck(moe_combine_triton, (expert_out.requires_grad_(), dest,
                                                              src, weights.requires_grad_()),
                                         test_utils=both),
        "combine_bf16": torch.library.opcheck(moe_combine_triton,
                                              (expert_out, dest, src, weights, torch.bfloat16),
                                              test_utils=both),
        "dispatch_bwd": torch.library.opcheck(moe_dispatch_bwd_triton, (dgrouped, dest, 5, 2),
                                              test_utils=schema),
        "combine_bwd": torch.library.opcheck(moe_combine_bwd_triton,
                                             (du, expert_out.detach(), dest, src,
                                              weights.detach()),
                                             test_utils=schema),
    }
    from titan_moe.ops.moe_dispatch import dispatch_layout_triton

    checks["layout"] = torch.library.opcheck(dispatch_layout_triton,
                                             (layout_pairs(30, 5, "random"), 5, 8, 64),
                                             test_utils=schema)
    return {f"{op}_{name}": str(outcome) for op, report in checks.items()
            for name, outcome in report.items()}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CASES)
def test_ops_match_float64_reference_under_interpreter(results, name, path):
    report = results[f"{name}-{path}"]
    assert "error" not in report, report["error"]
    assert [("_direct" in node) for node in report.pop("nodes")] == [path == "direct"] * 2
    assert report["dtypes_ok"] and report["grouped_exact"] and report["untaken_grad_zero"], report
    rows_bound = BF16_RTOL if CASES[name][5] == torch.bfloat16 else FP32_RTOL
    bounds = {"dz": rows_bound, "dexpert_out": rows_bound, "u": FP32_RTOL,
              "dweights": FP32_RTOL}
    for key, bound in bounds.items():
        assert report[key] <= bound, (key, report[key], bound)


@pytest.mark.parametrize(("name", "path"), [
    *((name, "op") for name in LAYOUT_CASES), *((name, "direct") for name in LAYOUT_DIRECT_CASES)])
def test_layout_op_equals_reference_under_interpreter(results, name, path):
    report = results[f"{name}-{path}"]
    assert "error" not in report, report["error"]
    assert report == {"dest": True, "src": True, "offs": True}, report


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", OUT_DTYPE_CASES)
def test_combine_in_bf16_is_the_fp32_combine_rounded_under_interpreter(results, name, path):
    report = results[f"out-dtype-{name}-{path}"]
    assert "error" not in report, report["error"]
    report.pop("u_equal")  # the interpreter truncates where CUDA rounds to nearest
    assert report == {"u_dtype": "torch.bfloat16", "u_rounded_or_truncated": True,
                      "grads_equal": [True, True]}, report


def test_reference_combine_in_bf16_is_the_fp32_combine_rounded():
    report = compare_out_dtype(
        lambda e, d, s, w, out_dtype=None: moe_combine_naive(e, d, w, out_dtype),
        make_inputs(*CASES["bf16-k3-d40-align8"]))
    assert report == {"u_dtype": "torch.bfloat16", "u_equal": True,
                      "u_rounded_or_truncated": True, "grads_equal": [True, True]}, report


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def _loop_reference(z, expert_out, weights, dest, n_rows, du, dgrouped):
    """Pair by pair in float64: grouped, dz, u, dexpert_out, dweights from their definitions."""
    n_tokens, top_k = weights.shape
    grouped = torch.zeros(n_rows, z.shape[1], dtype=torch.float64)
    dz = torch.zeros_like(z)
    u = torch.zeros(n_tokens, z.shape[1], dtype=torch.float64)
    de = torch.zeros(n_rows, z.shape[1], dtype=torch.float64)
    dw = torch.zeros_like(weights)
    for t in range(n_tokens):
        for j in range(top_k):
            row = int(dest[t * top_k + j])
            grouped[row] = z[t]
            dz[t] += dgrouped[row]
            u[t] += weights[t, j] * expert_out[row]
            de[row] = weights[t, j] * du[t]
            dw[t, j] = (expert_out[row] * du[t]).sum()
    return grouped, dz, u, de, dw


@pytest.mark.parametrize("name", ["k3-d20-align4", "k8-d64-align8"])
def test_reference_matches_pair_loop(name):
    n_tokens, top_k, n_experts, align, width, _ = CASES[name]
    z, expert_out, weights, dest, src, du, dgrouped = make_inputs(
        n_tokens, top_k, n_experts, align, width, torch.float64)
    expert_out = expert_out.nan_to_num().requires_grad_()
    z, weights = z.requires_grad_(), weights.double().requires_grad_()
    grouped = moe_dispatch_naive(z, dest, src.numel(), top_k)
    (dz,) = torch.autograd.grad(grouped, z, dgrouped)
    u = moe_combine_naive(expert_out, dest, weights)
    de, dw = torch.autograd.grad(u, (expert_out, weights), du.double())
    want = _loop_reference(z.detach(), expert_out.detach(), weights.detach(), dest, src.numel(),
                           du.double(), dgrouped)
    for got, expected in zip((grouped, dz, u, de, dw), want, strict=True):
        assert (got - expected).abs().max().item() <= LOOP_ATOL


def test_dispatcher_takes_the_reference_on_cpu(monkeypatch):
    def refuse(*args):
        raise AssertionError("the Triton op was called for CPU tensors")

    monkeypatch.setattr(dispatch_module, "moe_dispatch_triton", refuse)
    monkeypatch.setattr(dispatch_module, "moe_combine_triton", refuse)
    monkeypatch.setattr(dispatch_module, "dispatch_layout_triton", refuse)
    monkeypatch.setattr(dispatch_module, "moe_dispatch_call", refuse)
    monkeypatch.setattr(dispatch_module, "moe_combine_call", refuse)
    monkeypatch.setattr(dispatch_module, "dispatch_layout_call", refuse)
    pair_expert = layout_pairs(30, 5, "random")
    for got, want in zip(dispatch_layout(pair_expert, 5, 8),
                         dispatch_layout_naive(pair_expert, 5, 8), strict=True):
        assert torch.equal(got, want)
    z, expert_out, weights, dest, src, _, _ = make_inputs(4, 2, 3, 4, 8, torch.float32)
    assert torch.equal(moe_dispatch(z, dest, src, 2), moe_dispatch_naive(z, dest, src.numel(), 2))
    expert_out = expert_out.nan_to_num()
    assert torch.equal(moe_combine(expert_out, dest, src, weights),
                       moe_combine_naive(expert_out, dest, weights))


@pytest.mark.parametrize(("z_shape", "dest_len", "src_shape", "w_shape", "field"), [
    ((4, 8), 8, (16,), (4, 2), None),
    ((4, 8, 1), 8, (16,), (4, 2), "rows"),
    ((4, 8), 7, (16,), (4, 2), "dest"),
    ((4, 8), 8, (4, 4), (4, 2), "src"),
    ((4, 8), 8, (16,), (8,), "weights"),
])
def test_bad_inputs_name_the_field(z_shape, dest_len, src_shape, w_shape, field):
    z, dest = torch.randn(z_shape), torch.arange(dest_len)
    src, weights = torch.full(src_shape, -1), torch.rand(w_shape)

    def both():
        moe_dispatch(z, dest, src, 2)
        moe_combine(torch.randn(16, *z_shape[1:]), dest, src, weights)

    if field is None:
        both()
        return
    with pytest.raises(ValueError, match=field):
        both()


if __name__ == "__main__":
    reports = {f"{name}-{path}": guarded(run_case, *case, path)
               for name, case in CASES.items() for path in PATHS}
    reports.update({f"out-dtype-{name}-{path}": guarded(run_out_dtype_case, *CASES[name], path)
                    for name in OUT_DTYPE_CASES for path in PATHS})
    reports.update({f"{name}-op": guarded(run_layout_case, *case, "op")
                    for name, case in LAYOUT_CASES.items()})
    reports.update({f"{name}-direct": guarded(run_layout_case, *LAYOUT_CASES[name], "direct")
                    for name in LAYOUT_DIRECT_CASES})
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck)}))
