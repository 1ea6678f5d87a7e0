"""short_conv (causal depthwise conv + SiLU + optional per-head L2 norm): the PyTorch reference
against a per-token loop, and the Triton op (run by Triton's CPU interpreter in a child process,
see tests/ops/interpreter.py for why) against the reference in float64.

Op vs reference: y, dx and dweight as relative RMS error ||got − want|| / ||want||, the reference
run in float64 on the op's inputs (x already rounded to its dtype, the same dy). Bounds:
  fp32 x     FP32_RTOL for all three (fp32 arithmetic; observed ~1e-7).
  bf16 x     y and dx are stored in bf16, one rounding of each element; Triton's interpreter
             converts fp32 to bf16 by truncation (checked: its y equals the float64 reference
             truncated, bit for bit), relative RMS about 2^-7/√3 / 1.47 ≈ 3.1e-3 (8 significant
             bits, mantissas spread over [1, 2); ~1.6e-3 with the GPU's round to nearest),
             bound BF16_RTOL = 5e-3. dweight is fp32 and computed in fp32 from the exact bf16 x
             and dy the reference also sees: FP32_RTOL.
"""

import importlib
import json
import math

import pytest
import torch

import titan_moe.ops.short_conv as short_conv_module
from tests.metrics import rel_rms
from tests.ops.interpreter import guarded
from titan_moe.ops.short_conv import NORM_EPS, short_conv, short_conv_naive

FP32_RTOL = 1e-5
BF16_RTOL = 5e-3
LOOP_ATOL = 1e-12  # the reference against the per-token loop, both float64

# name -> (B, T, heads, head size, K, documents, per-head norm, x dtype, extra)
# extra: "zero-rows" zeroes x over a window so whole rows have a = 0 (the norm's eps branch);
# "small-tiles" runs 8-row blocks and few backward programs (each loops over several blocks,
# halos cross block edges inside documents); "int64-docs" passes int64 doc_ids to the op.
CASES = {
    "T13-K4-docs-norm": (2, 13, 2, 16, 4, True, True, torch.float32, None),
    "T37-K3-docs-norm-D24": (2, 37, 2, 24, 3, True, True, torch.float32, None),
    "T37-K4-norm": (2, 37, 2, 16, 4, False, True, torch.float32, None),
    "T29-K4-docs-no-norm-D24": (2, 29, 2, 24, 4, True, False, torch.float32, "int64-docs"),
    "T31-K3-no-norm": (2, 31, 2, 16, 3, False, False, torch.float32, None),
    "T37-K4-docs-norm-small-tiles": (2, 37, 2, 16, 4, True, True, torch.float32, "small-tiles"),
    "T23-K4-docs-norm-zero-rows": (2, 23, 2, 16, 4, True, True, torch.float32, "zero-rows"),
    "bf16-T37-K4-docs-norm": (2, 37, 2, 16, 4, True, True, torch.bfloat16, None),
    "bf16-T19-K3-no-norm-D24": (2, 19, 2, 24, 3, True, False, torch.bfloat16, None),
}


def documents(batch: int, seq_len: int) -> torch.Tensor:
    """[B, T] int32 document ids: row 0 starts documents at 1 (a one-token first document), 5,
    6 (one token again) and 11; row 1 at 3, 9 and 12."""
    starts = torch.zeros(batch, seq_len, dtype=torch.int32)
    starts[0, [1, 5, 6, 11]] = 1
    starts[1 % batch, [3, 9, 12]] = 1
    return starts.cumsum(1, dtype=torch.int32)


def make_inputs(batch, seq_len, heads, head_size, taps, with_docs, dtype, extra=None, seed=0):
    """x [B, T, C] rounded to dtype, weight [C, K] fp32, dy rounded to dtype, doc_ids or None."""
    gen = torch.Generator().manual_seed(seed)
    channels = heads * head_size
    x = torch.randn(batch, seq_len, channels, generator=gen).to(dtype)
    if extra == "zero-rows":
        x[0, 4:12] = 0  # rows 7..11 of sequence 0: every tap is zero, so a = 0
    weight = torch.rand(channels, taps, generator=gen) * 2 - 1
    dy = torch.randn(batch, seq_len, channels, generator=gen).to(dtype)
    return x, weight, dy, documents(batch, seq_len) if with_docs else None


def run_case(batch, seq_len, heads, head_size, taps, with_docs, norm, dtype, extra) -> dict:
    """The Triton op vs the float64 reference: y, dx, dweight and their dtypes."""
    from titan_moe.ops.short_conv import short_conv_triton

    # The module, not the op the package exports under the same name.
    kernels = importlib.import_module("titan_moe.ops.short_conv.short_conv_triton")
    launch = kernels.MAX_BLOCK_T, kernels.TARGET_PROGRAMS
    if extra == "small-tiles":
        kernels.MAX_BLOCK_T, kernels.TARGET_PROGRAMS = 8, 4  # 2 channel blocks: 2 row programs
    try:
        return _compare(short_conv_triton, kernels, batch, seq_len, heads, head_size, taps,
                        with_docs, norm, dtype, extra)
    finally:
        kernels.MAX_BLOCK_T, kernels.TARGET_PROGRAMS = launch


def _compare(op, kernels, batch, seq_len, heads, head_size, taps, with_docs, norm, dtype, extra):
    x, weight, dy, doc = make_inputs(batch, seq_len, heads, head_size, taps, with_docs, dtype,
                                     extra)
    head_dim = head_size if norm else None
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    want = short_conv_naive(x64, w64, doc, head_dim)
    want_dx, want_dw = torch.autograd.grad((want * dy.double()).sum(), (x64, w64))

    ours_x, ours_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    op_doc = doc.long() if extra == "int64-docs" else doc
    y = op(ours_x, ours_w, op_doc, head_dim or 0)
    dx, dw = torch.autograd.grad(y, (ours_x, ours_w), dy)
    return {"y": rel_rms(y, want), "dx": rel_rms(dx, want_dx), "dweight": rel_rms(dw, want_dw),
            "dtypes_ok": (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, torch.float32),
            **_launch_report(kernels, x, batch, seq_len, head_dim or 0)}


def _launch_report(kernels, x, batch, seq_len, head_dim) -> dict:
    """Row blocks a sequence (forward, backward) and backward programs a channel block."""
    _, _, fwd_rows, _ = kernels._launch(x, head_dim, kernels.FWD_TILE)
    _, _, bwd_rows, n_c_blocks = kernels._launch(x, head_dim, kernels.BWD_TILE)
    blocks = [math.ceil(seq_len / fwd_rows), math.ceil(seq_len / bwd_rows)]
    return {"row_blocks": blocks,
            "bwd_row_programs": min(batch * blocks[1], kernels.TARGET_PROGRAMS // n_c_blocks)}


def run_opcheck() -> dict:
    """torch.library.opcheck of both ops' schemas and the forward's autograd registration (the
    fake-tensor check runs on the GPU: under the interpreter Triton touches fake storage)."""
    from titan_moe.ops.short_conv import short_conv_bwd_triton, short_conv_triton

    x, weight, dy, doc = make_inputs(2, 13, 2, 16, 4, True, torch.float32)
    checks = torch.library.opcheck(
        short_conv_triton, (x.requires_grad_(), weight.requires_grad_(), doc, 16),
        test_utils=("test_schema", "test_autograd_registration"),
    )  # fmt: skip
    report = {f"fwd_{name}": str(outcome) for name, outcome in checks.items()}
    checks = torch.library.opcheck(short_conv_bwd_triton, (dy, x.detach(), weight.detach(), doc,
                                                           16), test_utils=("test_schema",))
    report.update({f"bwd_{name}": str(outcome) for name, outcome in checks.items()})
    return report


@pytest.mark.parametrize("name", CASES)
def test_op_matches_float64_reference_under_interpreter(results, name):
    report = results[name]
    assert "error" not in report, report["error"]
    assert report["dtypes_ok"], report
    half = CASES[name][7] == torch.bfloat16
    bounds = {"y": BF16_RTOL if half else FP32_RTOL, "dx": BF16_RTOL if half else FP32_RTOL,
              "dweight": FP32_RTOL}
    for key, bound in bounds.items():
        assert report[key] <= bound, (key, report[key], bound)


def test_small_tiles_case_spans_several_row_blocks(results):
    """The small-tiles case must really run several 8-row blocks a sequence (halos crossing
    block edges), forward and backward, and loop each backward program over several blocks
    (2 programs a channel block for 2 x 5 blocks), or it would test nothing the others do not."""
    report = results["T37-K4-docs-norm-small-tiles"]
    assert report["row_blocks"] == [5, 5] and report["bwd_row_programs"] == 2


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def _loop_reference(x, weight, doc_ids, head_dim):
    """Token by token, channel by channel, in Python floats (float64)."""
    batch, seq_len, channels = x.shape
    taps = weight.shape[1]
    xs, ws = x.tolist(), weight.tolist()
    out = torch.zeros(batch, seq_len, channels, dtype=torch.float64)
    for b in range(batch):
        for t in range(seq_len):
            a = []
            for c in range(channels):
                z = 0.0
                for j in range(taps):
                    src = t - (taps - 1 - j)
                    if src >= 0 and (doc_ids is None or doc_ids[b, src] == doc_ids[b, t]):
                        z += ws[c][j] * xs[b][src][c]
                a.append(z / (1.0 + math.exp(-z)))
            if head_dim:
                for h in range(0, channels, head_dim):
                    norm = math.sqrt(sum(v * v for v in a[h : h + head_dim]))
                    a[h : h + head_dim] = [v / max(norm, NORM_EPS) for v in a[h : h + head_dim]]
            out[b, t] = torch.tensor(a, dtype=torch.float64)
    return out


@pytest.mark.parametrize(("taps", "with_docs", "head_dim"),
                         [(4, True, 8), (3, True, None), (4, False, 16), (2, True, 16)])
def test_reference_matches_per_token_loop(taps, with_docs, head_dim):
    x, weight, _, doc = make_inputs(2, 15, 2, 8, taps, with_docs, torch.float64, "zero-rows")
    got = short_conv_naive(x, weight.double(), doc, head_dim)
    want = _loop_reference(x, weight.double(), doc, head_dim)
    assert (got - want).abs().max().item() <= LOOP_ATOL
    if head_dim:  # non-zero heads have unit norm, the zeroed ones stay zero
        norms = got.unflatten(-1, (-1, head_dim)).norm(dim=-1)
        assert ((norms - 1).abs() < 1e-12).sum() + (norms == 0).sum() == norms.numel()
        assert (norms == 0).any()


def test_reference_is_the_layers_former_arithmetic():
    """bf16 x, fp32 weight: conv, SiLU and the norm in fp32, one rounding to bf16 at the end."""
    x, weight, _, doc = make_inputs(2, 21, 2, 16, 4, True, torch.bfloat16)
    got = short_conv_naive(x, weight, doc, 16)
    conv = short_conv_module.causal_depthwise_conv(x, weight, doc)
    assert conv.dtype == torch.float32
    a = torch.nn.functional.silu(conv).unflatten(-1, (2, 16))
    want = torch.nn.functional.normalize(a, dim=-1, eps=1e-6).flatten(-2).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "doc_shape", "head_dim", "field"),
    [((2, 13), (32, 4), None, None, "x"), ((2, 13, 32), (16, 4), None, None, "weight"),
     ((2, 13, 32), (32,), None, None, "weight"), ((2, 13, 32), (32, 4), (2, 12), None, "doc_ids"),
     ((2, 13, 32), (32, 4), None, 12, "head_dim"), ((2, 13, 32), (32, 4), None, -16, "head_dim")],
)
def test_bad_inputs_name_the_field(x_shape, w_shape, doc_shape, head_dim, field):
    doc = None if doc_shape is None else torch.zeros(doc_shape, dtype=torch.int32)
    with pytest.raises(ValueError, match=field):
        short_conv(torch.zeros(x_shape), torch.zeros(w_shape), doc, head_dim)


def test_dispatcher_takes_the_reference_on_cpu(monkeypatch):
    x, weight, _, doc = make_inputs(2, 13, 2, 16, 4, True, torch.bfloat16)
    want = short_conv_naive(x, weight, doc, 16)
    calls = []

    def recording(*args):
        calls.append(args)
        return short_conv_naive(*args)

    def refuse(*args):
        raise AssertionError("the Triton op was called for CPU tensors")

    monkeypatch.setattr(short_conv_module, "short_conv_naive", recording)
    monkeypatch.setattr(short_conv_module, "short_conv_triton", refuse)
    got = short_conv(x, weight, doc, 16)
    assert len(calls) == 1 and torch.equal(got, want)


def test_kda_layer_routes_q_and_k_through_the_norm_and_v_without(monkeypatch):
    """The layer's seam: sequence_conv_act(x, weight, doc_ids, head_dim) with head_dim for q and
    k and None for v, each with its own conv weight."""
    from titan_moe.model.args import get_flavor
    from titan_moe.model.kda import KimiDeltaAttention

    args = get_flavor("debug")
    layer = KimiDeltaAttention(args)
    layer.init_weights(0.02, 0.02)
    seen = []

    def recording(x, weight, doc_ids, head_dim):
        seen.append((weight, head_dim))
        return short_conv(x, weight, doc_ids, head_dim)

    monkeypatch.setattr(layer, "sequence_conv_act", recording)
    layer(torch.randn(1, 16, args.dim))
    assert [h for _, h in seen] == [args.head_dim, args.head_dim, None]
    assert [w is p for (w, _), p in zip(seen, (layer.conv_q, layer.conv_k, layer.conv_v),
                                        strict=True)] == [True] * 3


if __name__ == "__main__":
    reports = {name: guarded(run_case, *case) for name, case in CASES.items()}
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck)}))
