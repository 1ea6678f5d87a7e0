"""bench/trace_host.py on a hand-made trace: each host thread's span and outermost ops, and the
ops some levels below a named op, each against values counted by hand."""

from collections import Counter

import pytest

from tests.bench_scripts import BENCH, load_bench


def _x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}


# Thread 1 (forward): region A twice; the first call runs aten::mm and a custom op, which runs a
# nonzero and a launch. Thread 2 (autograd): one backward node running aten::mm. A kernel (GPU
# side) must be ignored.
EVENTS = [
    _x("cpu_op", "Region A", 0, 100), _x("cpu_op", "aten::mm", 10, 20),
    _x("cpu_op", "titan_moe::op", 40, 50), _x("cpu_op", "aten::nonzero", 50, 10),
    _x("cuda_runtime", "cudaLaunchKernel", 70, 2),
    _x("cpu_op", "Region A", 120, 30), _x("cpu_op", "aten::mm", 125, 10),
    _x("cpu_op", "autograd::engine::evaluate_function: X", 0, 50, tid=2),
    _x("cpu_op", "aten::mm", 5, 20, tid=2),
    _x("kernel", "k1", 0, 500, tid=7),
]


@pytest.fixture
def trace_host(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports trace_gaps, as a script beside it
    return load_bench("trace_host")


def test_outermost_ops_and_span_of_each_thread(trace_host):
    threads = trace_host.outermost(EVENTS)
    assert set(threads) == {(0, 1), (0, 2)}
    span, time, calls = threads[(0, 1)]
    assert span == 150 and time == Counter({"Region A": 130}) and calls["Region A"] == 2
    span, time, _ = threads[(0, 2)]
    assert span == 50 and time == Counter({"autograd::engine::evaluate_function: X": 50})


def test_runtime_calls_of_each_thread_at_any_depth(trace_host):
    threads = trace_host.runtime_calls(EVENTS + [_x("cuda_driver", "cuLaunchKernel", 130, 3),
                                                  _x("cuda_runtime", "cudaLaunchKernel", 80, 4)])
    time, calls = threads[(0, 1)]
    assert time == Counter({"cudaLaunchKernel": 6, "cuLaunchKernel": 3})
    assert calls == Counter({"cudaLaunchKernel": 2, "cuLaunchKernel": 1})
    assert threads[(0, 2)] == (Counter(), Counter())


def test_ops_below_a_named_op_by_level(trace_host):
    n, total, time, calls = trace_host.under(EVENTS, "Region A", depth=1)
    assert (n, total) == (2, 130)
    assert time == Counter({"aten::mm": 30, "titan_moe::op": 50}) and calls["aten::mm"] == 2
    _, _, time, _ = trace_host.under(EVENTS, "Region A", depth=2)
    assert time == Counter({"aten::nonzero": 10, "cudaLaunchKernel": 2})
    n, total, time, _ = trace_host.under(EVENTS, "titan_moe::op")
    assert (n, total) == (1, 50) and time == Counter({"aten::nonzero": 10, "cudaLaunchKernel": 2})
