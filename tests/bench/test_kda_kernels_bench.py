"""bench/kda_kernels.py under Triton's interpreter (tests/ops/interpreter.py says why in a child
process): it records the op's launches of one forward and backward, in the order chunk_triton's
docstring gives (the backward runs from what the forward kept: none of the forward's kernels), and
times each at the given setting and at the op's own."""

import importlib
import json
import os
import subprocess
import sys

from tests.bench_scripts import BENCH

chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")
SCANS = ("state_scan_fwd_kernel", "state_scan_bwd_kernel")

LAUNCHES = [
    "gate_cumsum_kernel#1", "tile_products_kernel#1", "unit_lower_inverse_kernel#1",
    "ut_transform_kernel#1",
    "state_scan_fwd_kernel#1", "chunk_output_kernel#1",
    "chunk_output_bwd_kernel#1", "state_scan_bwd_kernel#1", "state_terms_bwd_kernel#1",
    "ut_transform_bwd_kernel#1", "tile_products_bwd_kernel#1", "gate_cumsum_bwd_kernel#1",
]


def test_records_the_op_launches_and_times_each_setting(tmp_path):
    out = tmp_path / "kda_kernels.json"
    command = [sys.executable, str(BENCH / "kda_kernels.py"), "--device", "cpu", "--shape",
               "1,64,1,16", "--warps", "2,4", "--stages", "1,2", "--iters", "1", "--out", str(out)]
    child = subprocess.run(command, cwd=BENCH.parent, capture_output=True, text=True,
                           env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["launch"] for r in rows] == LAUNCHES
    for r in rows:
        # fp32 inputs on CPU: IEEE GEMMs, so no operand setting; the scans never at 1 stage; the
        # op's own warps and stages (the scans' loop depth, a kernel's own num_stages, else
        # Triton's default 3).
        kernel = r["launch"].split("#")[0]
        want = ["- w2 s2", "- w4 s2"] if kernel in SCANS else [
            "- w2 s1", "- w2 s2", "- w4 s1", "- w4 s2"]
        assert list(r["ms"]) == want, r["ms"]
        assert all(isinstance(ms, float) and ms > 0 for ms in r["ms"].values())
        stages = (chunk_triton.SCAN_STAGES if kernel in SCANS
                  else chunk_triton.NUM_STAGES.get(kernel, 3))
        assert r["own"] == f"- w{chunk_triton.NUM_WARPS[kernel]} s{stages}" and r["own_ms"] > 0
        assert r["best_ms"] == min(r["ms"].values()) and r["ms"][r["best"]] == r["best_ms"]
