"""bench/moe.py on this host: our compiled layer is compiled with our Inductor passes, by default
every pass `compile.passes` installs (the JSON names them, and they fire), or with those --passes
names (none after the flag: none), as compile_passes.inspect takes them; an unknown name is one
argparse error naming the flag. --inductor KEY=VALUE options go to our layer's compiles only,
checked against torch._inductor.config's options and their types. With --rounds the layers are
timed in turn, round after round, and a row is the median of its rounds."""

import gc
import json
import statistics
import sys

import pytest
from torch._dynamo.utils import counters

from compile_passes.registry import COUNTER, PASS_NAMES
from tests.bench_scripts import BENCH, load_bench


@pytest.fixture
def moe(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("moe")


def _run(moe, monkeypatch, tmp_path, *extra: str) -> dict:
    out = tmp_path / "moe.json"
    monkeypatch.setattr(sys, "argv", ["moe.py", "--tiny", "--device", "cpu", "--out", str(out),
                                      *extra])
    counters.clear()
    moe.main()
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compiled_rows_use_the_trainers_passes_unless_told(moe, monkeypatch, tmp_path):
    result = _run(moe, monkeypatch, tmp_path)
    assert result["titan_moe_passes"] == list(PASS_NAMES)
    assert counters[COUNTER]["situ_glu"] > 0  # the shared and routed experts' SiTU-GLU
    assert [r["mode"] for r in result["layers"]] == ["eager", "compiled"]
    result = _run(moe, monkeypatch, tmp_path, "--passes")
    assert result["titan_moe_passes"] == [] and sum(counters[COUNTER].values()) == 0


def test_unknown_pass_names_the_flag(moe, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(moe, monkeypatch, tmp_path, "--passes", "situ_glu", "fuse_all")
    assert exit_info.value.code == 2
    assert "--passes: unknown pass 'fuse_all'; allowed: situ_glu" in capsys.readouterr().err


def test_trace_without_profile_names_the_flag(moe, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(moe, monkeypatch, tmp_path, "--trace")
    assert exit_info.value.code == 2
    assert "--trace: the trace is of --profile's call; give --profile N" in capsys.readouterr().err


def test_bad_inductor_settings_name_the_flag(moe, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(moe, monkeypatch, tmp_path, "--inductor", "combo_kernels=1")
    assert exit_info.value.code == 2
    assert ("--inductor: 'combo_kernels=1': combo_kernels takes a bool (default False)"
            in capsys.readouterr().err)


def test_inductor_settings_reach_our_compiles_only(moe, monkeypatch):
    seen = {}
    monkeypatch.setattr(moe.torch, "compile",
                        lambda layer, options: seen.setdefault(layer, options))
    extra = {"combo_kernels": True}
    for kind in ("titan_moe", "torchtitan"):
        moe.compiled(kind, kind, "graphed", [], extra)
    assert seen["titan_moe"]["combo_kernels"] is True
    assert seen["titan_moe"]["triton.cudagraphs"] is True  # the row's mode is kept
    assert "combo_kernels" not in seen["torchtitan"]


def test_timing_runs_with_the_collector_off(moe, monkeypatch):
    """Python's collector is off inside each timed call (as torchtitan's trainer runs) and on
    again after the rounds."""
    seen = []
    monkeypatch.setattr(moe, "timed",
                        lambda fn, device, warmup, iters: seen.append(gc.isenabled()) or 1.0)
    moe.time_rounds({"titan_moe": (lambda: None, lambda: None)}, "cpu", 0, 1, rounds=2)
    assert seen == [False] * 4 and gc.isenabled()


def test_rounds_time_the_layers_in_turn_and_report_the_median(moe, monkeypatch):
    order, clock = [], iter(range(100))

    def call(name):
        return lambda: order.append(name)

    # Each timed() call returns the next number of a counter: 8 calls, 2 layers x 2 x 2 rounds.
    monkeypatch.setattr(moe, "timed", lambda fn, device, warmup, iters: (fn(), next(clock))[1])
    calls = {"titan_moe": (call("ours fwd"), call("ours f+b")),
             "torchtitan": (call("tt fwd"), call("tt f+b"))}
    rows = moe.time_rounds(calls, "cpu", warmup=0, iters=1, rounds=2)
    assert order == ["ours fwd", "ours f+b", "tt fwd", "tt f+b"] * 2
    assert rows["titan_moe"]["fwd_bwd_ms_rounds"] == [1, 5]
    assert rows["torchtitan"]["fwd_ms_rounds"] == [2, 6]
    assert rows["torchtitan"]["fwd_bwd_ms"] == statistics.median([3, 7])


@pytest.mark.slow
def test_rounds_rows_keep_each_rounds_figure(moe, monkeypatch, tmp_path):
    result = _run(moe, monkeypatch, tmp_path, "--rounds", "3", "--passes")
    for row in result["layers"]:
        assert len(row["fwd_bwd_ms_rounds"]) == 3
        assert row["fwd_bwd_ms"] == statistics.median(row["fwd_bwd_ms_rounds"])
