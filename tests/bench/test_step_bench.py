"""bench/step.py's table when a row runs out of device memory: the row is kept as such and the
rows after it still run (no model is built: bench_one is replaced)."""

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


def test_out_of_memory_row_is_kept_and_later_rows_run(step, monkeypatch, tmp_path, capsys):
    def bench_one(opts, inputs, mode, device):
        if mode == "eager":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return _row(inputs, mode, 50.0)

    monkeypatch.setattr(step, "bench_one", bench_one)
    out = tmp_path / "step.json"
    assert step.main(["--smoke", "--inputs", "text", "--modes", "eager", "compiled",
                      "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["eager", "compiled"]
    assert rows[0]["ms"] is None
    assert rows[0]["out_of_memory"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows[1]["ms"] == 50.0 and rows[1]["speedup_vs_eager"] is None
    printed = capsys.readouterr().out
    assert "text eager out of memory at batch 2" in printed
    table = printed[printed.index("inputs "):].splitlines()
    assert table[1].split() == ["text", "eager", "out", "of", "memory"]
    assert table[2].split()[:3] == ["text", "compiled", "50.0"]
