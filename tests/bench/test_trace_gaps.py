"""bench/trace_gaps.py on a hand-made trace: the gaps between kernels of all streams together,
the host op that launched the kernel after each gap, the syncs inside it, and busy time, each
against values counted by hand."""

import gzip
import json

import pytest

from tests.bench_scripts import load_bench


def _x(cat, name, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


# Host: layer0 (0..100) launches k1 and k2; layer1 (150..400) waits in a stream sync
# (200..300), then launches k3. GPU: k1 [10, 60) on stream 7, k2 [40, 80) on stream 8
# (overlapping k1: the GPU is busy 10..80), k3 [310, 330), k4 [335, 345) launched in layer1.
EVENTS = [
    _x("cpu_op", "layer0", 0, 100), _x("cpu_op", "aten::mm", 5, 10),
    _x("cpu_op", "layer1", 150, 250), _x("cpu_op", "aten::nonzero", 190, 120),
    _x("cuda_runtime", "cudaLaunchKernel", 6, 2, correlation=1),
    _x("cuda_runtime", "cudaLaunchKernel", 20, 2, correlation=2),
    _x("cuda_runtime", "cudaStreamSynchronize", 200, 100),
    _x("cuda_runtime", "cudaLaunchKernel", 305, 2, correlation=3),
    _x("cuda_runtime", "cudaLaunchKernel", 320, 2, correlation=4),
    _x("kernel", "k1", 10, 50, tid=7, correlation=1),
    _x("kernel", "k2", 40, 40, tid=8, correlation=2),
    _x("kernel", "k3", 310, 20, tid=7, correlation=3),
    _x("kernel", "k4", 335, 10, tid=7, correlation=4),
]


def test_gaps_busy_and_span_by_hand():
    gaps, busy, span = load_bench("trace_gaps").find_gaps(EVENTS)
    assert busy == pytest.approx(70 + 20 + 10)  # 10..80 once, not k1 + k2
    assert span == pytest.approx(345 - 10)
    first, second = gaps  # longest first
    assert (first.start_us, first.us, first.before, first.after) == (70, 230, "k2", "k3")
    assert first.launched_by == "layer1 > aten::nonzero"  # host ops around k3's launch
    assert first.syncs == ("cudaStreamSynchronize",)
    assert (second.us, second.after, second.launched_by, second.syncs) == (5, "k4", "layer1", ())


def test_short_gaps_are_left_out_and_the_launchers_summed(tmp_path, capsys):
    bench = load_bench("trace_gaps")
    gaps, _, _ = bench.find_gaps(EVENTS, min_us=20)
    assert [g.after for g in gaps] == ["k3"]
    by_launcher = bench.idle_by_launcher(bench.find_gaps(EVENTS)[0])
    assert by_launcher == [("layer1 > aten::nonzero", 230, 1), ("layer1", 5, 1)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert bench.main([str(path), "--min-us", "20"]) == 0
    out = capsys.readouterr().out
    assert "idle in gaps >= 20 us: 0.23 ms in 1 gaps" in out
    assert "cudaStreamSynchronize" in out
