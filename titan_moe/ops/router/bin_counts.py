"""Per-expert bin counts of the QB histogram, counted in shared memory on CUDA.

    hist[e, bins[t, e]] += 1   for every t with bins[t, e] >= 0     bins [T, E] int16 -> [E, n_bins]

`titan_moe::count_bins` is what the routing op calls with `counting="shared"`, where the kernel
writes each (token, expert) bin instead of adding it to the histogram in global memory: 14.7M
relaxed global atomics at T 16384, E 896 cost 0.1 ms of the op's 0.25 (H200, 2026-12-05), and
Triton exposes no shared-memory atomics (bench/qb_histogram_static.py).

A block owns 32 experts, one a lane, over one split of the tokens, in shared memory laid out
bin-major: counts[b * 32 + lane] is lane's expert's count of bin b, so a lane only ever
addresses its own bank and the 32 atomics of a warp instruction never meet (bank or address);
the block's warps, on other tokens, meet only through the atomics. Each warp reads a token's 32
bins as one coalesced 64-byte row. The blocks of a split write its counts to a partial
[splits, E, n_bins]; the splits are summed after. The first kernel (2026-12-06) gave each thread
a token and a few experts' rows: a warp's 32 atomics then went to random banks of one expert's
row, and to the same address wherever two tokens shared a bin. It counted at about one atomic a
clock an SM whatever its width, threads, unrolling or splits (0.074-0.089 ms graphed at T 16384,
E 896 on the H100; `bench/results/count_bins_variants-2026-12-06-h100.json`), and the op lost
to the global atomics (0.268 against 0.235 ms on the H200). Predicted for this layout on the
H100 at T 16384, E 896: 28 expert groups x 4 splits, 4,096 warp atomics a block with no
conflicts, about 5-10 us, plus about 10 us to write and sum the 14 MB of partials.

The kernel is CUDA C compiled at first use by NVRTC (`torch.cuda._compile_kernel`): the default
implementation (any other device, and the reference the GPU test compares with) is one
scatter_add, also where NVRTC is missing or the device cannot give a block SHARED_BYTES
(`shared_counting_available` says whether the kernel counts).
"""

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

LANES = 32  # experts a block: one a lane of each warp
BLOCK_THREADS = 512
SHARED_BYTES = 160 * 1024  # within the opt-in shared memory of sm_80 (163 KB) and sm_90 (227 KB)
MAX_BINS = SHARED_BYTES // (4 * LANES)  # a block's [n_bins, 32] int32 counts must fit
MIN_SPLIT_TOKENS = 1024  # fewer tokens a block would spend more on its zeroing and flush

KERNEL_SOURCE = r"""
extern "C" __global__ void count_bins(const short* __restrict__ bins, int* __restrict__ partial,
                                      int n_tokens, int n_experts, int n_bins,
                                      int tokens_per_split) {
    extern __shared__ int counts[];  // [n_bins][32]: bin-major, a lane's expert in its own bank
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int first = blockIdx.x * 32;
    const int expert = first + lane;
    const int t0 = blockIdx.y * tokens_per_split;
    const int t1 = min(n_tokens, t0 + tokens_per_split);
    for (int i = threadIdx.x; i < n_bins * 32; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    if (expert < n_experts) {
        const short* column = bins + expert;
        int t = t0 + warp;
        // Four tokens' loads in flight before their atomics.
        for (; t + 3 * warps < t1; t += 4 * warps) {
            const int b0 = column[(long long)t * n_experts];
            const int b1 = column[(long long)(t + warps) * n_experts];
            const int b2 = column[(long long)(t + 2 * warps) * n_experts];
            const int b3 = column[(long long)(t + 3 * warps) * n_experts];
            if (b0 >= 0) atomicAdd(&counts[b0 * 32 + lane], 1);
            if (b1 >= 0) atomicAdd(&counts[b1 * 32 + lane], 1);
            if (b2 >= 0) atomicAdd(&counts[b2 * 32 + lane], 1);
            if (b3 >= 0) atomicAdd(&counts[b3 * 32 + lane], 1);
        }
        for (; t < t1; t += warps) {
            const int b = column[(long long)t * n_experts];
            if (b >= 0) atomicAdd(&counts[b * 32 + lane], 1);
        }
    }
    __syncthreads();
    // Consecutive threads read consecutive experts of a bin (no bank conflict) and write them
    // n_bins apart; the split's other blocks fill the rest of each line in L2.
    int* out = partial + (long long)blockIdx.y * n_experts * n_bins;
    const int width = min(32, n_experts - first);
    for (int i = threadIdx.x; i < n_bins * 32; i += blockDim.x) {
        const int e = i & 31;
        if (e < width) out[(long long)(first + e) * n_bins + (i >> 5)] = counts[i];
    }
}
"""


def token_splits(n_tokens: int, n_experts: int, n_sms: int) -> int:
    """Splits of the tokens, so that blocks of 32 experts by split fill the SMs once (a block's
    counts take most of an SM's shared memory), each split at least MIN_SPLIT_TOKENS."""
    groups = -(-n_experts // LANES)
    return max(1, min(n_sms // groups, n_tokens // MIN_SPLIT_TOKENS))


@functools.cache
def _kernel(device_index: int):
    """The NVRTC-compiled kernel for one device, or None where NVRTC cannot build it or the
    device cannot give a block SHARED_BYTES."""
    major, minor = torch.cuda.get_device_capability(device_index)
    try:
        with torch.cuda.device(device_index):
            kernel = torch.cuda._compile_kernel(KERNEL_SOURCE, "count_bins",
                                                compute_capability=f"{major}{minor}")
            # the opt-in above 48 KB a block (MAX_BINS bins fill SHARED_BYTES)
            kernel.set_shared_memory_config(SHARED_BYTES)
            return kernel
    except (AttributeError, OSError, RuntimeError, TypeError) as err:
        log.warning("count_bins: NVRTC could not build the shared-memory kernel (%s); it "
                    "counts with one scatter_add", err)
        return None


def shared_counting_available(device: torch.device, n_bins: int) -> bool:
    """Whether `count_bins` counts on this device in shared memory (CUDA, NVRTC present, the
    device gives a block SHARED_BYTES, a block's 32 experts' rows fit them)."""
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
    if n_experts == 0:
        return torch.empty(0, n_bins, dtype=torch.int32, device=bins.device)
    n_sms = torch.cuda.get_device_properties(bins.device).multi_processor_count
    splits = token_splits(n_tokens, n_experts, n_sms)
    partial = torch.empty(splits, n_experts, n_bins, dtype=torch.int32, device=bins.device)
    kernel(grid=(-(-n_experts // LANES), splits, 1), block=(BLOCK_THREADS, 1, 1),
           args=[bins, partial, n_tokens, n_experts, n_bins, -(-n_tokens // splits)],
           shared_mem=n_bins * LANES * 4)
    return partial[0] if splits == 1 else partial.sum(0, dtype=torch.int32)
