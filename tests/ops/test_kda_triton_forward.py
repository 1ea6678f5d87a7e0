"""Triton chunked KDA forward, run by Triton's CPU interpreter, against the float64 recurrence.

The interpreter is picked when @triton.jit decorates and again when Triton lazily imports its
own helpers, so TRITON_INTERPRET=1 has to hold for a whole process: flipping it inside the pytest
process fails in Triton 3.6 and would turn other tests' kernels into interpreted ones. All cases
therefore run in one child process (this file run as a script) that reports relative errors.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

FP32_RTOL = 1e-4  # float32 kernel vs float64 recurrence
G_MIN = -5.0
HEADS = 2
CHILD_TIMEOUT_S = 120

# name -> (batch, seq_len, d_k, d_v, gate, with_initial_state, output_final_state)
CASES = {
    f"T{seq_len}-{gate}": (1, seq_len, 32, 16, gate, True, True)
    for seq_len in (64, 128)
    for gate in ("pinned", "near_zero", "random")
}
CASES["padded-T100-no-initial"] = (2, 100, 16, 16, "random", False, True)
CASES["K24-V80-two-v-blocks"] = (1, 64, 24, 80, "random", True, True)
CASES["no-final-state"] = (1, 64, 16, 16, "random", True, False)


def make_inputs(batch, seq_len, d_k, d_v, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, HEADS, d_k)
    q = F.normalize(torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, seq_len, HEADS, d_v, generator=gen, dtype=torch.float64)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if gate == "pinned":
        g = torch.full(shape, G_MIN, dtype=torch.float64)
    elif gate == "near_zero":
        g = -1e-3 * u
    else:
        g = G_MIN * u
    beta = torch.rand(batch, seq_len, HEADS, generator=gen, dtype=torch.float64)
    h0 = torch.randn(batch, HEADS, d_k, d_v, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def run_case(batch, seq_len, d_k, d_v, gate, with_initial, output_final) -> dict:
    """Kernel (float32) vs naive_recurrent_kda (float64); runs in the interpreter process."""
    from titan_moe.ops.kda import naive_recurrent_kda
    from titan_moe.ops.kda.triton_forward import chunk_kda_fwd_triton

    q, k, v, g, beta, h0 = make_inputs(batch, seq_len, d_k, d_v, gate)
    h0 = h0 if with_initial else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    # An exp beyond fp32's range inside a kernel surfaces as a NumPy RuntimeWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        o, s = chunk_kda_fwd_triton(
            *(x.float() for x in (q, k, v, g, beta)),
            initial_state=None if h0 is None else h0.float(),
            output_final_state=output_final,
        )
    return {
        "o_shape_ok": o.shape == o_ref.shape and o.dtype == torch.float32,
        "o_err": rel_err(o, o_ref),
        "s_err": None if s is None else rel_err(s, s_ref),
    }


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_matches_recurrence(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["o_shape_ok"]
    assert result["o_err"] <= FP32_RTOL
    if CASES[name][-1]:
        assert result["s_err"] is not None and result["s_err"] <= FP32_RTOL
    else:
        assert result["s_err"] is None


if __name__ == "__main__":
    report = {}
    for name, case in CASES.items():
        try:
            report[name] = run_case(*case)
        except Exception as error:  # reported per case so one failure names itself
            report[name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(report))
