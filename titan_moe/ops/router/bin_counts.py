"""Per-expert bin counts of the QB histogram, counted in shared memory on CUDA.

    hist[e, bins[t, e]] += 1   for every t with bins[t, e] >= 0     bins [T, E] int16 -> [E, n_bins]

`titan_moe::count_bins` is what the routing op calls with `counting="shared"`, where the kernel
writes each (token, expert) bin instead of adding it to the histogram in global memory: 14.7M
relaxed global atomics at T 16384, E 896 cost 0.1 ms of the op's 0.25 (H200, 2026-12-05), and
Triton exposes no shared-memory atomics (bench/qb_histogram_static.py). Here one CUDA block owns
a few experts' [n_bins] rows in shared memory over all T tokens, so every count is a
shared-memory atomic and every histogram entry is written once, with no global atomic and no
zeroing pass. Predicted ~15 us at T 16384, E 896 on the H200 (7 experts a block, 128 blocks of
28 KB); measured 0.076 ms graphed (2026-12-06), and with the bins' writes the op lost to the
atomics (0.268 against 0.235 ms), so the op counts with atomics by default. Bank conflicts are
not what bounds it: a block of 32 experts, one a lane, with its counts bin-major (a lane only
ever addressing its own bank; 83a1689, reverted) was equal to the reference and slower, 0.125 ms
graphed on an H100 (`bench/results/qb_route-2026-12-06-h100-83a1689.json`) against this
kernel's 0.076 on another H100 in the previous session (the op with global atomics took 0.231
and 0.233 ms in the two runs). Both run at about one counted element a clock an SM, the rate of
the shared-memory atomic unit, so any kernel that counts with shared atomics takes >= 56 us
here (14.7M on 132 SMs); counting faster needs plain loads and stores on counts private to one
warp.

The kernel is CUDA C compiled at first use by NVRTC (`torch.cuda._compile_kernel`): the default
implementation (any other device, and the reference the GPU test compares with) is one
scatter_add, also where NVRTC is missing (`shared_counting_available` says whether it is).
"""

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

BLOCK_THREADS = 512
SHARED_BYTES = 48 * 1024  # what a block gets without opting in to more
MAX_BINS = SHARED_BYTES // 4  # one expert's int32 row must fit

KERNEL_SOURCE = r"""
extern "C" __global__ void count_bins(const short* __restrict__ bins, int* __restrict__ hist,
                                      int n_tokens, int n_experts, int n_bins,
                                      int experts_per_block) {
    extern __shared__ int counts[];
    const int first = blockIdx.x * experts_per_block;
    const int width = min(experts_per_block, n_experts - first);
    const int n_counts = width * n_bins;
    for (int i = threadIdx.x; i < n_counts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    // A thread a token: its `width` bins are adjacent int16s, one sector, read once from L2.
    for (int t = threadIdx.x; t < n_tokens; t += blockDim.x) {
        const short* row = bins + (long long)t * n_experts + first;
        for (int j = 0; j < width; ++j) {
            const int b = row[j];
            if (b >= 0) atomicAdd(&counts[j * n_bins + b], 1);
        }
    }
    __syncthreads();
    int* out = hist + (long long)first * n_bins;
    for (int i = threadIdx.x; i < n_counts; i += blockDim.x) out[i] = counts[i];
}
"""


def experts_per_block(n_experts: int, n_bins: int, n_sms: int) -> int:
    """Enough experts a block to fill the SMs once, no more than shared memory holds."""
    return max(1, min(SHARED_BYTES // (4 * n_bins), -(-n_experts // n_sms)))


@functools.cache
def _kernel(device_index: int):
    """The NVRTC-compiled kernel for one device, or None where NVRTC cannot build it."""
    major, minor = torch.cuda.get_device_capability(device_index)
    try:
        with torch.cuda.device(device_index):
            kernel = torch.cuda._compile_kernel(KERNEL_SOURCE, "count_bins",
                                                compute_capability=f"{major}{minor}")
            # torch's launcher asks for an opt-in at 48 KB itself (a row of MAX_BINS fills it)
            kernel.set_shared_memory_config(SHARED_BYTES)
            return kernel
    except (AttributeError, OSError, RuntimeError, TypeError) as err:
        log.warning("count_bins: NVRTC could not build the shared-memory kernel (%s); it "
                    "counts with one scatter_add", err)
        return None


def shared_counting_available(device: torch.device, n_bins: int) -> bool:
    """Whether `count_bins` counts on this device in shared memory (CUDA, NVRTC present, one
    expert's row fits a block)."""
    if device.type != "cuda" or not 0 < n_bins <= MAX_BINS:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel(index) is not None


def count_bins_reference(bins: Tensor, n_bins: int) -> Tensor:
    """bins [T, E] int16 (negative: not counted) -> hist [E, n_bins] int32, by one scatter_add."""
    n_experts = bins.shape[1]
    counted = (bins >= 0).to(torch.int32)
    flat = bins.long().clamp_min(0) + torch.arange(n_experts, device=bins.device).mul(n_bins)
    hist = torch.zeros(n_experts * n_bins, dtype=torch.int32, device=bins.device)
    return hist.scatter_add_(0, flat.reshape(-1), counted.reshape(-1)).view(n_experts, n_bins)


@torch.library.custom_op("titan_moe::count_bins", mutates_args=())
def count_bins(bins: Tensor, n_bins: int) -> Tensor:
    """bins [T, E] int16 (negative: not counted) -> hist [E, n_bins] int32."""
    return count_bins_reference(bins, n_bins)


@count_bins.register_fake
def _(bins: Tensor, n_bins: int) -> Tensor:
    return bins.new_empty(bins.shape[1], n_bins, dtype=torch.int32)


@count_bins.register_kernel("cuda")
def _(bins: Tensor, n_bins: int) -> Tensor:
    if not shared_counting_available(bins.device, n_bins):
        return count_bins_reference(bins, n_bins)
    kernel = _kernel(bins.device.index)
    n_tokens, n_experts = bins.shape
    bins = bins.contiguous()
    hist = torch.empty(n_experts, n_bins, dtype=torch.int32, device=bins.device)
    if n_experts == 0:
        return hist
    n_sms = torch.cuda.get_device_properties(bins.device).multi_processor_count
    width = experts_per_block(n_experts, n_bins, n_sms)
    kernel(grid=(-(-n_experts // width), 1, 1), block=(BLOCK_THREADS, 1, 1),
           args=[bins, hist, n_tokens, n_experts, n_bins, width],
           shared_mem=width * n_bins * 4)
    return hist
