"""bench/generate.py --smoke on CPU: two contexts of one batch through prefill, the compiled
decode step (compiled by the first row only) and the JSON/table; the 1K-ratio bookkeeping on
made-up rows."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "bench" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_rows_and_merges(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "generate.json"
    bench.main(["--smoke", "--contexts", "64,128", "--batches", "2", "--out", str(out)])
    bench.main(["--smoke", "--contexts", "64,128", "--batches", "1", "--compile", "none",
                "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {(r["context"], r["batch"]): r for r in data["rows"]}
    assert set(rows) == {(64, 2), (128, 2), (64, 1), (128, 1)}
    # One decode-step compile a batch size: the second context reuses it (slot dim dynamic).
    assert rows[(64, 2)]["graphs_compiled"] == 1 and rows[(128, 2)]["graphs_compiled"] == 0
    assert rows[(64, 1)]["graphs_compiled"] == rows[(128, 1)]["graphs_compiled"] == 0  # eager
    r = rows[(128, 2)]
    assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["step_ms"] > 0
    assert r["mla_cache_slots"] == 128 + 2 + 8  # context + warmup + decode tokens
    # tiny dims: 2 MLA layers x 2 rows x 138 slots x (16 + 8) channels x 4 bytes
    assert r["mla_cache_MiB"] == pytest.approx(2 * 2 * 138 * 24 * 4 / 2**20)
    assert rows[(64, 1)]["kda_state_MiB"] == rows[(128, 1)]["kda_state_MiB"] > 0
    assert "decode tok/s" in capsys.readouterr().out


def test_ratios_and_goal():
    bench = _bench()
    rows = [{"context": 1024, "batch": 1, "decode_tok_s": 300.0},
            {"context": 131072, "batch": 1, "decode_tok_s": 180.0},
            {"context": 524288, "batch": 1, "decode_tok_s": 160.0},
            {"context": 131072, "batch": 8, "decode_tok_s": 100.0}]
    out = {(r["context"], r["batch"]): r for r in bench.with_ratios(rows)}
    assert out[(131072, 1)]["slowdown_vs_1k"] == pytest.approx(300 / 180)
    assert out[(131072, 1)]["goal_met"] is False  # 1.67 > 1.5
    assert out[(524288, 1)]["goal_met"] is True  # 1.875 <= 2
    assert "slowdown_vs_1k" not in out[(131072, 8)]  # no 1K row for batch 8
