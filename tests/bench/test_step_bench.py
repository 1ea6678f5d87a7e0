"""bench/step.py's table when a row does not run: a row out of device memory is kept as a result,
a row that fails is kept as a defect (exit status 1); either way the rows after it still run (no
model is built: bench_one is replaced)."""

import json

import pytest
import torch

from tests.bench_scripts import BENCH, load_bench


@pytest.fixture
def step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("step")


def _row(inputs: str, mode: str, ms: float) -> dict:
    return {"inputs": inputs, "mode": mode, "ms": ms, "host_ms": 1.0, "first_step_s": 1.0,
            "tokens_per_s": 10.0, "patches_per_s": 0.0, "tflops": 1.0, "mfu_pct": None,
            "peak_mem_gib": None, "passes_matched": {}, "profile": {}, "cudagraph_skips": None}


def _run(step, monkeypatch, tmp_path, failing: dict[str, Exception]) -> tuple[int, list]:
    def bench_one(opts, inputs, mode, device):
        if mode in failing:
            raise failing[mode]
        return _row(inputs, mode, 50.0)

    monkeypatch.setattr(step, "bench_one", bench_one)
    out = tmp_path / "step.json"
    status = step.main(["--smoke", "--inputs", "text", "--modes", "eager", "compiled",
                        "compiled+passes", "--out", str(out)])
    return status, json.loads(out.read_text())["rows"]


def test_out_of_memory_row_is_kept_and_later_rows_run(step, monkeypatch, tmp_path, capsys):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    status, rows = _run(step, monkeypatch, tmp_path, {"eager": oom})
    assert status == 0  # a measured limit, not a defect
    assert [r["mode"] for r in rows] == ["eager", "compiled", "compiled+passes"]
    assert rows[0]["ms"] is None and rows[0]["out_of_memory"] is True
    assert rows[0]["failure"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows[1]["ms"] == 50.0 and rows[1]["speedup_vs_eager"] is None
    printed = capsys.readouterr().out
    assert "text eager out of memory at batch 2" in printed
    table = printed[printed.index("inputs "):].splitlines()
    assert table[1].split()[:5] == ["text", "eager", "out", "of", "memory:"]
    assert table[2].split()[:3] == ["text", "compiled", "50.0"]


def test_failing_row_is_kept_and_the_run_exits_1(step, monkeypatch, tmp_path, capsys):
    error = RuntimeError("Triton compile failed\nlong details")
    status, rows = _run(step, monkeypatch, tmp_path, {"compiled": error})
    assert status == 1
    assert [r["ms"] for r in rows] == [50.0, None, 50.0]
    assert rows[1]["out_of_memory"] is False
    assert rows[1]["failure"] == "RuntimeError: Triton compile failed"
    assert rows[2]["speedup_vs_eager"] == 1.0
    captured = capsys.readouterr()
    assert "text compiled failed: RuntimeError: Triton compile failed" in captured.out
    assert "Traceback" in captured.err
