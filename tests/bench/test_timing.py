"""bench/timing.py's device_profile: of the two calls it makes under the profiler, the trace
holds the second's ops only (the first carries the profiler's start-up cost on the host)."""

import gzip
import json

import torch

from tests.bench_scripts import load_bench


def test_device_profile_records_the_second_call_only(tmp_path):
    timing = load_bench("timing")
    calls = []

    def fn():
        with torch.profiler.record_function(f"call_{len(calls)}"):
            calls.append(torch.ones(8).sum())

    trace = tmp_path / "trace.json.gz"
    timing.device_profile(fn, step_ms=1.0, trace=trace)
    with gzip.open(trace) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert len(calls) == 2
    assert "call_1" in names and "call_0" not in names
