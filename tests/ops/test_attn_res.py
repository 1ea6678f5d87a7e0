"""The AttnRes site op: the PyTorch reference against the docstring's formulas, the Triton op (run
by Triton's CPU interpreter in a child process, see tests/ops/interpreter.py for why) against
the reference evaluated in float64, the dispatcher and input validation.

Op vs float64 reference is relative RMS error, ||got - want|| / ||want||, per tensor: the output
and the gradients of every source, query and gain. The op computes in fp32 from the sources'
exact values, so the output and the fp32 gradients (fp32 sources, query, gain) are bounded by
FP32_RTOL (seen: ≤ 2e-6). A bf16 (fp16) source's gradient is stored in bf16 (fp16), 8 (11)
significant bits: on CUDA one rounding to nearest, ~1.7e-3 (2e-4) relative RMS for bf16 (fp16);
Triton's interpreter truncates fp32 -> bf16/fp16 instead (its fptrunc ignores the rounding
mode), which doubles that (seen: 2.7e-3 to 3.7e-3 for bf16). HALF_RTOL = 1e-2 holds either way
and fails on any real mistake (a wrong or missing term of dV_i is an O(1) relative error).
"""

import json

import pytest
import torch

from tests.metrics import rel_rms
from tests.ops.interpreter import guarded
from titan_moe.ops import attn_res as attn_res_ops
from titan_moe.ops.attn_res import attn_res_mix, attn_res_mix_naive, attn_res_mix_triton

FP32_RTOL = 1e-5
HALF_RTOL = 1e-2
EPS = 1e-6
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# name -> (leading dims, d, source dtypes, non-contiguous sources, output dtype)
CASES = {
    "n1-fp32-rows7-d24": ((7,), 24, [F32], False, F32),
    "n2-fp32-rows2x3-d40": ((2, 3), 40, [F32, F32], False, F32),
    "n2-fp16-rows6-d33": ((6,), 33, [F16, F16], False, F32),
    "n5-mixed-rows13-d64": ((13,), 64, [F32] + [BF16] * 4, False, F32),
    "n9-mixed-rows11-d48": ((11,), 48, [F32] + [BF16] * 8, False, F32),
    "n9-fp32-rows37-d24-loop": ((37,), 24, [F32] * 9, False, F32),  # 5 row blocks, 2 programs
    "n3-mixed-noncontiguous": ((2, 5), 40, [F32, BF16, BF16], True, F32),
    # 8192 // 5 // 256 = 6 rows before rounding: the forward's BLOCK_ROWS must be a power of two.
    "n5-mixed-rows9-d256": ((9,), 256, [F32] + [BF16] * 4, False, F32),
    # The model's sites: the output written in the sources' dtype, its gradient read in it.
    "n4-bf16-rows21-d48-bf16-out": ((21,), 48, [BF16] * 4, False, BF16),
    "n2-fp16-rows6-d33-fp16-out": ((6,), 33, [F16, F16], False, F16),
}


def make_inputs(lead, dim, dtypes, noncontiguous, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = []
    for i, dtype in enumerate(dtypes):
        # Different scales per source, so the RMS normalisation matters.
        v = torch.randn(*lead, dim, generator=gen) * (0.5 + i)
        if noncontiguous:
            v = torch.randn(dim, *lead, generator=gen).movedim(0, -1) * (0.5 + i)
        sources.append(v.to(dtype))
    query = torch.randn(dim, generator=gen)
    gain = torch.rand(dim, generator=gen) + 0.5
    grad_out = torch.randn(*lead, dim, generator=gen)
    return sources, query, gain, grad_out


def _grads(fn, sources, query, gain, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in [*sources, query, gain]]
    out = fn(leaves[:-2], leaves[-2], leaves[-1], EPS)
    grads = torch.autograd.grad((out * grad_out.to(out.dtype)).sum(), leaves)
    return out, grads


def run_case(lead, dim, dtypes, noncontiguous, out_dtype) -> dict:
    sources, query, gain, grad_out = make_inputs(lead, dim, dtypes, noncontiguous)
    assert noncontiguous == any(not v.is_contiguous() for v in sources)
    grad_out = grad_out.to(out_dtype)  # the gradient arrives in the output's dtype

    def op(*args):
        return attn_res_mix_triton(*args, out_dtype=out_dtype)

    out, grads = _grads(op, sources, query, gain, grad_out)
    want, want_grads = _grads(attn_res_mix_naive, [v.double() for v in sources], query.double(),
                              gain.double(), grad_out.double())
    names = [f"d_source{i}" for i in range(len(sources))] + ["d_query", "d_gain"]
    report = {"out": rel_rms(out, want)}
    report.update({n: rel_rms(g, w) for n, g, w in zip(names, grads, want_grads, strict=True)})
    report["dtypes_ok"] = out.dtype == out_dtype and out.shape == sources[0].shape and all(
        g.dtype == x.dtype and g.shape == x.shape
        for g, x in zip(grads, [*sources, query, gain], strict=True))
    return report


def run_bwd_into() -> dict:
    """attn_res_bwd_into with sources 0 and 2 adding into buffers that hold earlier sums and
    source 1 written fresh, against attn_res_bwd's returned gradients added by PyTorch."""
    from titan_moe.ops.attn_res.attn_res_triton import attn_res_bwd, attn_res_bwd_into, attn_res_fwd

    sources, query, gain, grad_out = make_inputs((13,), 48, [F32, BF16, BF16], False)
    grad_out = grad_out.bfloat16()
    u = (gain * query).float()
    _, stats = attn_res_fwd(sources, query, gain, EPS, BF16)
    *want, want_du = attn_res_bwd(sources, stats, u, grad_out)
    earlier = [torch.randn_like(v) for v in sources]
    grads = [earlier[0].clone(), torch.full_like(sources[1], float("nan")), earlier[2].clone()]
    du = attn_res_bwd_into(sources, stats, u, grad_out, grads, [True, False, True])
    expected = [earlier[0] + want[0], want[1], earlier[2].float() + want[2].float()]
    report = {f"d_source{i}": rel_rms(g, w) for i, (g, w) in enumerate(zip(grads, expected,
                                                                              strict=True))}
    report["du"] = rel_rms(du, want_du)
    report["dtypes_ok"] = all(g.dtype == v.dtype for g, v in zip(grads, sources, strict=True))
    return report


def run_opcheck() -> dict:
    from titan_moe.ops.attn_res.attn_res_triton import attn_res_fwd

    sources, query, gain, _ = make_inputs((5,), 24, [F32, BF16, F32], False)
    args = ([v.requires_grad_() for v in sources], query.requires_grad_(),
            gain.requires_grad_(), EPS, BF16)
    tests = ("test_schema", "test_autograd_registration")
    return {name: str(result) for name, result in
            torch.library.opcheck(attn_res_fwd, args, test_utils=tests).items()}


@pytest.mark.parametrize("name", CASES)
def test_op_matches_float64_reference_under_interpreter(results, name):
    report = results[name]
    assert "error" not in report, report.get("error")
    assert report.pop("dtypes_ok")
    dtypes, out_dtype = CASES[name][2], CASES[name][4]
    # A bf16 (fp16) output is the fp32 result rounded once: HALF_RTOL as for the gradients.
    bounds = {"out": FP32_RTOL if out_dtype == F32 else HALF_RTOL, "d_query": FP32_RTOL,
              "d_gain": FP32_RTOL}
    bounds.update({f"d_source{i}": FP32_RTOL if dtype == F32 else HALF_RTOL
                   for i, dtype in enumerate(dtypes)})
    assert report.keys() == bounds.keys()
    for key, value in report.items():
        assert value <= bounds[key], (key, value)


def test_backward_into_buffers_adds_where_asked(results):
    # fp32: one fp32 rounding of the sum. bf16: the kernel adds the unrounded fp32 part to the
    # buffer and rounds once, the reference adds the part rounded to bf16: within a few bf16
    # roundings of each other, far under HALF_RTOL. A buffer written fresh holds no NaN left.
    report = results["bwd_into"]
    assert "error" not in report, report.get("error")
    assert report.pop("dtypes_ok")
    bounds = {"d_source0": FP32_RTOL, "d_source1": HALF_RTOL, "d_source2": HALF_RTOL,
              "du": FP32_RTOL}
    assert report.keys() == bounds.keys()
    for key, value in report.items():
        assert value <= bounds[key], (key, value)


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def _formula(sources, query, gain, eps, grad_out):
    """out and the gradients from naive.py's docstring, row by row in float64."""
    dim = sources[0].shape[-1]
    u = gain * query
    rows = [v.reshape(-1, dim) for v in sources]
    out = torch.zeros_like(rows[0])
    grads = [torch.zeros_like(v) for v in rows]
    du = torch.zeros_like(u)
    g_rows = grad_out.reshape(-1, dim)
    for t in range(rows[0].shape[0]):
        vs = [v[t] for v in rows]
        r = [float(torch.rsqrt((v * v).mean() + eps)) for v in vs]
        s = [ri * float(v @ u) for ri, v in zip(r, vs, strict=True)]
        p = torch.softmax(torch.tensor(s, dtype=torch.float64), 0).tolist()
        out[t] = sum(pi * v for pi, v in zip(p, vs, strict=True))
        g = g_rows[t]
        dp = [float(g @ v) for v in vs]
        c = sum(pi * dpi for pi, dpi in zip(p, dp, strict=True))
        for i, v in enumerate(vs):
            ds = p[i] * (dp[i] - c)
            grads[i][t] = p[i] * g + ds * r[i] * u - ds * s[i] * r[i] ** 2 / dim * v
            du += ds * r[i] * v
    shape = sources[0].shape
    return out.reshape(shape), [x.reshape(shape) for x in grads] + [du * gain, du * query]


@pytest.mark.parametrize("n", [1, 4])
def test_reference_and_its_autograd_match_the_docstring_formulas(n):
    sources, query, gain, grad_out = make_inputs((2, 3), 16, [F32] * n, False, seed=n)
    sources = [v.double() for v in sources]
    query, gain, grad_out = query.double(), gain.double(), grad_out.double()
    out, grads = _grads(attn_res_mix_naive, sources, query, gain, grad_out)
    want, want_grads = _formula(sources, query, gain, EPS, grad_out)
    assert (out - want).abs().max().item() <= 1e-12
    for got, expected in zip(grads, want_grads, strict=True):
        assert (got - expected).abs().max().item() <= 1e-12 * max(1.0, expected.abs().max())


def test_dispatcher_takes_the_reference_on_cpu(monkeypatch):
    def refuse(*args):
        raise AssertionError("the Triton op was called for CPU tensors")

    monkeypatch.setattr(attn_res_ops, "attn_res_mix_triton", refuse)
    sources, query, gain, _ = make_inputs((4,), 24, [F32, BF16, BF16], False)
    assert not attn_res_ops.uses_triton(sources)
    got = attn_res_mix(sources, query, gain, EPS)
    assert got.dtype == F32
    assert torch.equal(got, attn_res_mix_naive(sources, query, gain, EPS))
    assert attn_res_mix([v.double() for v in sources], query.double(), gain.double(),
                        EPS).dtype == torch.float64


def test_dispatcher_would_take_triton_only_for_cuda_and_supported_dtypes():
    """uses_triton by device, dtype and n, on stand-ins for CUDA tensors (none here)."""

    class Cuda:  # only is_cuda and dtype are read
        def __init__(self, dtype, is_cuda=True):
            self.dtype, self.is_cuda = dtype, is_cuda

    assert attn_res_ops.uses_triton([Cuda(F32), Cuda(BF16)])
    assert attn_res_ops.uses_triton([Cuda(F16)] * 9)
    assert not attn_res_ops.uses_triton([Cuda(F32)] * 10)
    assert not attn_res_ops.uses_triton([Cuda(torch.float64)])
    assert not attn_res_ops.uses_triton([Cuda(F32, is_cuda=False)])


def test_tiles_are_powers_of_two_for_every_source_count_and_width():
    """The forward divides its tile budget by n: what is left must still be a power of two of
    rows (tl.arange), which the debug model's widths broke on the H200 (2026-12-04)."""
    from titan_moe.ops.attn_res import attn_res_triton as kernels

    for n in range(1, kernels.MAX_SOURCES + 1):
        for dim in (24, 48, 96, 256, 384, 512, 2048, 7168):
            for budget in (kernels.FWD_ROW_ELEMENTS // n, kernels.BWD_ROW_ELEMENTS):
                rows, block_d, _ = kernels._blocks(dim, budget)
                assert rows >= 1 and rows & (rows - 1) == 0, (n, dim, rows)
                assert rows * block_d <= max(budget, block_d), (n, dim, rows)


@pytest.mark.parametrize(
    ("fn", "n", "shapes", "dtype", "field"),
    [(attn_res_mix, 0, {}, F32, "at least 1 sources, got n=0"),
     (attn_res_mix, 2, {1: (3, 9)}, F32, "source 1 is"),
     (attn_res_mix, 2, {"query": (9,)}, F32, "query must be"),
     (attn_res_mix, 2, {"gain": (1, 8)}, F32, "gain must be"),
     (attn_res_mix, 2, {}, torch.int32, "floating point"),
     (attn_res_mix_triton, 10, {}, F32, "at most 9 sources, got n=10"),
     (attn_res_mix_triton, 2, {}, torch.float64, "fp32/bf16/fp16")],
)
def test_bad_inputs_raise_a_clear_error(fn, n, shapes, dtype, field):
    sources = [torch.ones(shapes.get(i, (3, 8)), dtype=dtype) for i in range(n)]
    query, gain = torch.zeros(shapes.get("query", (8,))), torch.ones(shapes.get("gain", (8,)))
    with pytest.raises(ValueError, match=field):
        fn(sources, query, gain, EPS)


if __name__ == "__main__":
    reports = {name: guarded(run_case, *case) for name, case in CASES.items()}
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck),
                      "bwd_into": guarded(run_bwd_into)}))
