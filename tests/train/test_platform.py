"""The CPU platform adapter: torchtitan's Trainer runs FSDP2 over gloo and matches one process.

Reference: the same global batch and the same initial weights trained by one process (no
sharding) must give the same per-step loss and gradient norm as two FSDP2 ranks over gloo.
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchtitan.tools import utils as tt_utils

from tests.distributed.train_jobs import register, shared_runs
from titan_moe.train.platform import resolve_device_type, use_platform

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
GLOBAL_BATCH = 4
# fp32 throughout; sharded and unsharded runs differ only in the order of gradient sums.
RTOL = 1e-5
SMOKE = [
    "--experimental.custom_import", "tests.train.smoke_spec",
    "--model.name", "titan_moe_smoke", "--model.flavor", "tiny",
    "--training.seq_len", "64", "--training.steps", str(STEPS),
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
    "--metrics.disable_color_printing", "--training.device", "cpu",
    # torchtitan lowers the collective timeout to 100 s after the first step; on a loaded
    # 2-core CI machine one rank can lag that long, and gloo's timeout aborts the process.
    "--comm.train_timeout_seconds", "600",
]


def scalars(dump: Path) -> dict[str, list[tuple[int, float]]]:
    (run_dir,) = glob.glob(str(dump / "tb" / "*"))
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    out = {tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in tags["scalars"]}
    out["histograms"] = tags["histograms"]
    return out


PROFILE = ["--profiling.enable_profiling", "--profiling.profile_freq", "3",
           "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"]
# Launched with the other test modules' trainer runs (tests/distributed/train_jobs.py).
register("platform/one", 1, [*SMOKE, "--training.local_batch_size", str(GLOBAL_BATCH), *PROFILE])
register("platform/two", 2, [*SMOKE, "--training.local_batch_size", str(GLOBAL_BATCH // 2)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """one, two: (dump folder, log) of the run on that many processes."""
    shared = shared_runs(tmp_path_factory)
    return {n: shared[f"platform/{n}"] for n in ("one", "two")}


def test_two_process_fsdp_over_gloo_matches_one_process(runs):
    two_log = runs["two"][1]
    assert "dp_shard=2" in two_log and "Applied FSDP to the model" in two_log
    one, two = scalars(runs["one"][0]), scalars(runs["two"][0])
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        assert [s for s, _ in two[tag]] == list(range(1, STEPS + 1))
        expected = torch.tensor([v for _, v in one[tag]], dtype=torch.float64)
        got = torch.tensor([v for _, v in two[tag]], dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=0.0, msg=tag)


def test_cpu_metrics_omit_mfu_and_log_moe(runs):
    one_dump, one_log = runs["one"]
    one = scalars(one_dump)
    assert "mfu(%)" not in one and "mfu:" not in one_log
    assert one["memory/max_reserved(GiB)"][-1][1] > 0
    assert one["throughput(tps)"][-1][1] > 0
    violations = [v for _, v in one["moe/max_violation"]]
    torch.testing.assert_close(violations, [1.0 / s for s in range(1, STEPS + 1)])
    assert one["histograms"] == ["moe/expert_load_relative"]


def test_cpu_profiler_writes_a_chrome_trace(runs):
    traces = runs["one"][0] / "profile_traces"
    (trace,) = glob.glob(str(traces / "iteration_3" / "rank0_trace.json"))
    events = json.loads(Path(trace).read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in events)
    assert any(e.get("cat") == "cpu_op" for e in events)


MONITOR_PROBE = """
import torch
from titan_moe.train.platform import HostMemoryMonitor
monitor = HostMemoryMonitor()
before = monitor.get_peak_stats().max_reserved_gib
block = torch.ones(2**28 // 4)  # 0.25 GiB, touched, so resident
print(before, monitor.get_peak_stats().max_reserved_gib)
"""


def test_host_memory_monitor_sees_a_fresh_allocation():
    # A fresh process: in this one, freed pages of earlier tests can hold the allocation.
    result = subprocess.run([sys.executable, "-c", MONITOR_PROBE], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    before, after = map(float, result.stdout.split())
    assert after - before > 0.9 * 0.25, (before, after)


def test_device_choice():
    assert resolve_device_type("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="training.device must be one of"):
        resolve_device_type("tpu")


def test_cuda_platform_is_a_no_op():
    before = (tt_utils.device_type, tt_utils.device_module, tt_utils.get_peak_flops)
    use_platform("cuda")
    assert (tt_utils.device_type, tt_utils.device_module, tt_utils.get_peak_flops) == before
