"""Platform adapter: run torchtitan 0.2.2's Trainer on CPU (gloo) as well as CUDA (nccl).

torchtitan 0.2.2 assumes an accelerator. `torchtitan.tools.utils` binds
`device_type, device_module = ("cuda", torch.cuda)` at import when no accelerator is
present, and several modules copy those names at import (`from ... import device_type`).
On CUDA nothing here changes anything. On CPU, `use_cpu()` applies these patches, each
covering one assumption:

1. `device_type`/`device_module` rebound to ("cpu", torch.cpu) in every module that copied
   them: the device mesh (`parallel_dims`), the process-group backend choice
   (`distributed.utils` maps "cpu" to gloo), profiling and metrics all read these globals.
2. The device-memory monitor reads the CUDA caching allocator (`memory_stats`,
   `get_device_properties`), which torch.cpu does not have; on CPU it reports the process
   resident set size instead (peak RSS between two log steps).
3. `set_pg_timeouts` calls `barrier(device_ids=[device_module.current_device()])`, and
   torch.cpu.current_device() returns the string "cpu" where barrier needs an index;
   `distributed.utils` gets a device module whose current_device() is 0.
4. The profiler asks for `[CPU, CUDA-or-XPU]` activities and passes None when neither exists,
   which torch.profiler rejects; on CPU the Trainer profiles with the CPU activity alone,
   on the same schedule and into the same Chrome/Perfetto trace files.
5. `get_peak_flops` looks the device name up in a table of GPUs and falls back to the A100's
   312 TFLOPS; a CPU has no entry, so it returns nan and MFU is not reported.

`PlatformTrainer` covers two more by subclassing instead of patching:
6. The Trainer names its device `{device_type}:{LOCAL_RANK}`, but CPU has only index 0.
7. FSDP2 reduce-scatters gradients with ReduceOp.AVG or PREMUL_SUM (a gradient divide factor),
   which NCCL has and gloo has not; on CPU every FSDP module reduces with SUM and divides
   after (`set_force_sum_reduction_for_comms`), which gives the same gradients.
"""

import contextlib
import math
import os
import types
from collections.abc import Iterator

import torch
import torchtitan.train as tt_train
from torch.distributed.fsdp import FSDPModule
from torchtitan.components import metrics as tt_metrics
from torchtitan.config import Profiling as ProfilingConfig
from torchtitan.distributed import parallel_dims as tt_parallel_dims
from torchtitan.distributed import utils as tt_dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools import profiling as tt_profiling
from torchtitan.tools import utils as tt_utils
from torchtitan.train import Trainer

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_GIB = 1024**3


def resolve_device_type(choice: str) -> str:
    """Map `training.device` ("auto" | "cpu" | "cuda") to the device type to run on."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"training.device must be one of {DEVICE_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device is 'cuda' but no CUDA device is available")
    return choice


def use_platform(device_type: str) -> None:
    """Adapt torchtitan to `device_type`; call before the Trainer is built."""
    if device_type == "cpu":
        use_cpu()


def use_cpu() -> None:
    """Apply the CPU patches 1-5 of the module docstring (idempotent)."""
    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    tt_metrics.device_type, tt_metrics.device_module = "cpu", torch.cpu
    tt_parallel_dims.device_type = "cpu"
    tt_profiling.device_module = torch.cpu
    tt_dist_utils.device_type = "cpu"
    tt_dist_utils.device_module = _CPU_WITH_INDEX
    tt_metrics.build_device_memory_monitor = HostMemoryMonitor
    tt_train.maybe_enable_profiling = cpu_profiling
    tt_utils.get_peak_flops = lambda device_name: math.nan


_CPU_WITH_INDEX = types.SimpleNamespace(current_device=lambda: 0, synchronize=torch.cpu.synchronize)


@contextlib.contextmanager
def cpu_profiling(
    config: ProfilingConfig, *, global_step: int = 0, base_folder: str = "", leaf_folder: str = ""
) -> Iterator[torch.profiler.profile | None]:
    """torchtitan's `maybe_enable_profiling` with the CPU activity only."""
    if not config.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(base_folder, config.save_traces_folder)
    rank = torch.distributed.get_rank()

    def export(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num}", leaf_folder)
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))

    wait = config.profile_freq - config.profiler_warmup - config.profiler_active
    schedule = torch.profiler.schedule(
        wait=wait, warmup=config.profiler_warmup, active=config.profiler_active
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=export, record_shapes=True
    ) as prof:
        prof.step_num = global_step
        yield prof


def running_on_cpu() -> bool:
    """True once torchtitan has been adapted to CPU."""
    return tt_utils.device_type == "cpu"


class HostMemoryMonitor:
    """Process memory in the shape of torchtitan's DeviceMemoryMonitor.

    Peak = the kernel's resident-set high-water mark (VmHWM), which writing "5" to
    /proc/self/clear_refs resets, so each log window reports its own peak.
    """

    def __init__(self) -> None:
        self.device_name = "cpu"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / _GIB
        self.reset_peak_stats()

    def get_peak_stats(self) -> tt_metrics.DeviceMemStats:
        peak_gib = _peak_rss_bytes() / _GIB
        pct = 100 * peak_gib / self.device_capacity_gib
        return tt_metrics.DeviceMemStats(peak_gib, pct, peak_gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # without the reset the peak is the process lifetime's, still a valid bound


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PlatformTrainer(Trainer):
    """torchtitan's Trainer with the CPU fixes 6 and 7 of the module docstring."""

    def init_distributed(self) -> ParallelDims:
        if running_on_cpu():
            self.device = torch.device("cpu")
        return super().init_distributed()

    def train(self) -> None:
        if running_on_cpu():
            for part in self.model_parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)
        super().train()
