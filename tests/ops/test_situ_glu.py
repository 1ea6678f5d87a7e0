"""The SiTU-GLU Triton ops, separate and packed (ab = [a | b]), run by Triton's CPU interpreter
in a child process (see tests/ops/interpreter.py), against the PyTorch reference in float64 on
the op's own inputs (tests/model/test_situ_glu.py checks the reference against the formula in
NumPy). Each case runs both ways: through the triton_op (as compiled graphs and tracers take
it) and through its direct eager call (`*_call`, titan_moe.ops.direct_call), whose autograd node
must be the direct Function's, not the dispatcher's.

h, ∂a and ∂b as relative RMS error ||got − want|| / ||want||. Bounds:
  fp32   FP32_RTOL: fp32 arithmetic; the interpreter's tanh comes from exp (no libdevice), which
         loses a few bits near 0 (observed below 1e-6).
  bf16   BF16_RTOL: each output is one bf16 rounding of an fp32 value, which the interpreter does
         by truncation (about 3.1e-3 relative RMS; 1.6e-3 with the GPU's round to nearest).
"""

import json

import pytest
import torch

from tests.metrics import rel_rms
from tests.ops.interpreter import guarded
from titan_moe.ops.situ_glu import situ_glu_naive, situ_glu_packed_naive

FP32_RTOL = 1e-5
BF16_RTOL = 5e-3
BETA1, BETA2 = 4.0, 25.0

# name -> (shape, dtype, input scale): sizes that leave a partial last block, inputs that
# saturate tanh and σ (scale 40), and a bf16 [rows, hidden] block as the experts have it.
CASES = {
    "fp32-3x1000": ((3, 1000), torch.float32, 3.0),
    "fp32-saturating-4x700": ((4, 700), torch.float32, 40.0),
    "bf16-64x96": ((64, 96), torch.bfloat16, 3.0),
    "bf16-saturating-5000": ((5000,), torch.bfloat16, 40.0),
}


PATHS = ("op", "direct")


def run_case(shape, dtype, scale, path) -> dict:
    from titan_moe.ops.situ_glu import situ_glu_call, situ_glu_triton

    gen = torch.Generator().manual_seed(0)
    a, b, dh = ((torch.randn(shape, generator=gen) * s).to(dtype) for s in (scale, scale, 1.0))
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    want = situ_glu_naive(a64, b64, BETA1, BETA2)
    want_da, want_db = torch.autograd.grad(want, (a64, b64), dh.double())
    ours_a, ours_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    h = (situ_glu_triton if path == "op" else situ_glu_call)(ours_a, ours_b, BETA1, BETA2)
    node = type(h.grad_fn).__name__
    da, db = torch.autograd.grad(h, (ours_a, ours_b), dh)
    return {"h": rel_rms(h, want), "da": rel_rms(da, want_da), "db": rel_rms(db, want_db),
            "dtypes_ok": (h.dtype, da.dtype, db.dtype) == (dtype,) * 3, "node": node}


# name -> (rows, hidden, dtype, input scale): the packed op reads a and b from ab's halves
PACKED_CASES = {
    "packed-fp32-7x300": (7, 300, torch.float32, 3.0),
    "packed-bf16-saturating-33x96": (33, 96, torch.bfloat16, 40.0),
}


def compare_packed(packed_op, ab: torch.Tensor, dh: torch.Tensor) -> dict:
    """packed_op(ab) and its ∂ab against the float64 reference of the separate halves (any
    device): relative RMS errors of h, ∂a and ∂b, and whether shapes and dtypes are ab's."""
    rows, hidden = ab.shape[0], ab.shape[1] // 2
    ab64 = ab.double().requires_grad_()
    want = situ_glu_naive(ab64[:, :hidden], ab64[:, hidden:], BETA1, BETA2)
    (want_dab,) = torch.autograd.grad(want, ab64, dh.double())
    ours = ab.clone().requires_grad_()
    h = packed_op(ours, BETA1, BETA2)
    node = type(h.grad_fn).__name__
    (dab,) = torch.autograd.grad(h, ours, dh)
    return {"h": rel_rms(h, want), "da": rel_rms(dab[:, :hidden], want_dab[:, :hidden]),
            "db": rel_rms(dab[:, hidden:], want_dab[:, hidden:]),
            "shapes_ok": (tuple(h.shape), tuple(dab.shape)) == ((rows, hidden), (rows, 2 * hidden)),
            "dtypes_ok": (h.dtype, dab.dtype) == (ab.dtype,) * 2, "node": node}


def run_packed_case(rows, hidden, dtype, scale, path) -> dict:
    """The packed Triton op (interpreted) against the float64 reference."""
    from titan_moe.ops.situ_glu import situ_glu_packed_call, situ_glu_packed_triton

    gen = torch.Generator().manual_seed(2)
    ab = (torch.randn(rows, 2 * hidden, generator=gen) * scale).to(dtype)
    dh = torch.randn(rows, hidden, generator=gen).to(dtype)
    return compare_packed(situ_glu_packed_triton if path == "op" else situ_glu_packed_call, ab, dh)


def run_opcheck() -> dict:
    """torch.library.opcheck of both ops' schemas and the forward's autograd registration (the
    fake-tensor check runs on the GPU: under the interpreter Triton touches fake storage)."""
    from titan_moe.ops.situ_glu import (
        situ_glu_bwd_triton,
        situ_glu_packed_bwd_triton,
        situ_glu_packed_triton,
        situ_glu_triton,
    )

    gen = torch.Generator().manual_seed(1)
    a, b, dh = (torch.randn(4, 40, generator=gen) for _ in range(3))
    tests = ("test_schema", "test_autograd_registration")
    report = {f"fwd_{name}": str(outcome) for name, outcome in torch.library.opcheck(
        situ_glu_triton, (a.requires_grad_(), b.requires_grad_(), BETA1, BETA2),
        test_utils=tests).items()}
    report |= {f"bwd_{name}": str(outcome) for name, outcome in torch.library.opcheck(
        situ_glu_bwd_triton, (dh, a.detach(), b.detach(), BETA1, BETA2),
        test_utils=("test_schema",)).items()}
    ab = torch.cat([a.detach(), b.detach()], dim=-1)
    report |= {f"packed_{name}": str(outcome) for name, outcome in torch.library.opcheck(
        situ_glu_packed_triton, (ab.requires_grad_(), BETA1, BETA2), test_utils=tests).items()}
    report |= {f"packed_bwd_{name}": str(outcome) for name, outcome in torch.library.opcheck(
        situ_glu_packed_bwd_triton, (dh, ab.detach(), BETA1, BETA2),
        test_utils=("test_schema",)).items()}
    return report


def _check_path(report: dict, path: str) -> None:
    """The direct call's autograd node is its own Function's; the op's is the dispatcher's."""
    assert ("_direct" in report["node"]) == (path == "direct"), report["node"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CASES)
def test_op_matches_float64_reference_under_interpreter(results, name, path):
    report = results[f"{name}-{path}"]
    assert "error" not in report, report["error"]
    assert report["dtypes_ok"], report
    _check_path(report, path)
    bound = BF16_RTOL if CASES[name][1] == torch.bfloat16 else FP32_RTOL
    assert max(report[k] for k in ("h", "da", "db")) <= bound, report


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", PACKED_CASES)
def test_packed_op_matches_float64_reference_under_interpreter(results, name, path):
    report = results[f"{name}-{path}"]
    assert "error" not in report, report["error"]
    assert report["dtypes_ok"] and report["shapes_ok"], report
    _check_path(report, path)
    bound = BF16_RTOL if PACKED_CASES[name][2] == torch.bfloat16 else FP32_RTOL
    assert max(report[k] for k in ("h", "da", "db")) <= bound, report


def test_packed_reference_is_the_separate_reference_of_the_halves():
    """Exact: the packed reference is the separate one applied to ab's two halves."""
    ab = torch.randn(5, 2 * 24, dtype=torch.float64)
    assert torch.equal(situ_glu_packed_naive(ab, BETA1, BETA2),
                       situ_glu_naive(ab[:, :24], ab[:, 24:], BETA1, BETA2))


def test_packed_input_of_odd_width_names_the_field():
    from titan_moe.ops.situ_glu import situ_glu_packed

    with pytest.raises(ValueError, match="ab must be"):
        situ_glu_packed(torch.zeros(2, 5))


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def test_mismatched_inputs_name_the_fields():
    from titan_moe.ops.situ_glu import situ_glu_triton

    with pytest.raises(ValueError, match="a and b must have one shape"):
        situ_glu_triton(torch.zeros(2, 3), torch.zeros(3, 2), BETA1, BETA2)
    with pytest.raises(ValueError, match="a and b must have one dtype"):
        situ_glu_triton(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16), BETA1, BETA2)


if __name__ == "__main__":
    reports = {f"{name}-{path}": guarded(run_case, *case, path)
               for name, case in CASES.items() for path in PATHS}
    reports |= {f"{name}-{path}": guarded(run_packed_case, *case, path)
                for name, case in PACKED_CASES.items() for path in PATHS}
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck)}))
