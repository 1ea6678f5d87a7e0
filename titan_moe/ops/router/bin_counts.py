"""The QB histogram counted from the routing kernel's cutoffs, in shared memory on CUDA.

    s[t, e] = σ(logits[t, e]),  r = alpha[t] - s[t, e]
    hist[e, clamp(floor((r - lo) · n_bins / (hi - lo)), 0, n_bins - 1)] += 1
        for every t whose alpha[t] is a number (NaN: a token not counted)
    lo, hi = min(b) - 1, max(b) + 1                                  (histogram.qb_range)

`titan_moe::count_bins` is what the routing op calls with `counting="shared"`: its kernel routes
and stores each token's cutoff alpha (the (k+1)-th largest s + b), and this kernel counts. 14.7M
relaxed global atomics at T 16384, E 896 cost 0.1 ms of the op's 0.25 (H200, 2026-12-05), and
Triton exposes no shared-memory atomics (bench/qb_histogram_static.py). Here one CUDA block owns
a few experts' [n_bins] rows in shared memory over all T tokens, so every count is a
shared-memory atomic and every histogram entry is written once, with no global atomic and no
zeroing pass. Measured with the bins written by the routing kernel and read here: 0.076 ms
graphed (H100, 2026-12-06) and the op 0.206 against the atomics' 0.233, of which 0.077 routes
and about 0.05 computed and wrote the [T, E] int16 bins. A block of 32 experts, one a lane, with
its counts bin-major (a lane only ever addressing its own bank; 83a1689, reverted) was equal to
the reference and slower, 0.125 ms on an H100
(`bench/results/qb_route-2026-12-06-h100-83a1689.json`): both run at about one counted element
a clock an SM, the shared-memory atomic unit's rate, so bank conflicts are not the bound and any
count with shared atomics takes >= 56 us here (14.7M on 132 SMs). So the bins are now computed
here, from the logits, where that work hides behind the atomics, and the routing kernel writes T
cutoffs instead of T x E bins: predicted on the H100 about 0.08 ms for this kernel and 0.16 for
the op (issue 20.1's bound: 0.2).

σ, the range and the bin are the routing kernel's fp32 operations (libdevice's expf, IEEE
division, no contraction), so the counts equal `count_bins_reference` bit for bit on CUDA.
The kernel is CUDA C compiled at first use by NVRTC (`torch.cuda._compile_kernel`), one build
for fp32 and one for bf16 logits: the default implementation (any other device, and the
reference the GPU test compares with) is `histogram.qb_histogram`, also where NVRTC is missing
(`shared_counting_available` says whether it is).
"""

import functools
import logging

import torch
from torch import Tensor

from titan_moe.ops.router.histogram import qb_histogram

log = logging.getLogger(__name__)

BLOCK_THREADS = 512
SHARED_BYTES = 48 * 1024  # what a block gets without opting in to more
MAX_BINS = SHARED_BYTES // 4  # one expert's int32 row must fit
LOGIT_TYPES = {torch.float32: "float", torch.bfloat16: "bf16"}

KERNEL_SOURCE = r"""
#ifdef LOGITS_BF16
typedef unsigned short logit_t;
__device__ __forceinline__ float logit_value(logit_t v) {
    return __uint_as_float(((unsigned)v) << 16);  // bf16 bits -> fp32, exact
}
#else
typedef float logit_t;
__device__ __forceinline__ float logit_value(logit_t v) {
    return v;
}
#endif

extern "C" __global__ void count_bins(const logit_t* __restrict__ logits,
                                      const float* __restrict__ bias,
                                      const float* __restrict__ alpha, int* __restrict__ hist,
                                      int n_tokens, int n_experts, int n_bins,
                                      int experts_per_block) {
    extern __shared__ int counts[];
    __shared__ float range[2];  // lo, n_bins / (hi - lo)
    const int first = blockIdx.x * experts_per_block;
    const int width = min(experts_per_block, n_experts - first);
    const int n_counts = width * n_bins;
    if (threadIdx.x < 32) {  // the range from every expert's bias (exact min and max)
        float lo = __int_as_float(0x7f800000), hi = -__int_as_float(0x7f800000);  // +-inf
        for (int e = threadIdx.x; e < n_experts; e += 32) {
            lo = fminf(lo, bias[e]);
            hi = fmaxf(hi, bias[e]);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
        }
        if (threadIdx.x == 0) {
            lo = __fsub_rn(lo, 1.0f);
            hi = __fadd_rn(hi, 1.0f);
            range[0] = lo;
            range[1] = __fdiv_rn((float)n_bins, __fsub_rn(hi, lo));
        }
    }
    for (int i = threadIdx.x; i < n_counts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    const float lo = range[0], scale = range[1], last = (float)(n_bins - 1);
    // A thread a token: its `width` logits are adjacent, one or two sectors read once from L2.
    for (int t = threadIdx.x; t < n_tokens; t += blockDim.x) {
        const float a = alpha[t];
        if (a != a) continue;  // NaN: not counted
        const logit_t* row = logits + (long long)t * n_experts + first;
        for (int j = 0; j < width; ++j) {
            const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-logit_value(row[j]))));
            const float v = floorf(__fmul_rn(__fsub_rn(__fsub_rn(a, s), lo), scale));
            // fmaxf takes 0 for a NaN score (a diverged step), as the reference's nan_to_num.
            atomicAdd(&counts[j * n_bins + (int)fminf(fmaxf(v, 0.0f), last)], 1);
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
def _kernel(device_index: int, logit_type: str):
    """The NVRTC-compiled kernel for one device and logit type, or None where NVRTC cannot
    build it."""
    major, minor = torch.cuda.get_device_capability(device_index)
    source = ("#define LOGITS_BF16\n" if logit_type == "bf16" else "") + KERNEL_SOURCE
    try:
        with torch.cuda.device(device_index):
            kernel = torch.cuda._compile_kernel(source, "count_bins",
                                                compute_capability=f"{major}{minor}")
            # torch's launcher asks for an opt-in at 48 KB itself (a row of MAX_BINS fills it)
            kernel.set_shared_memory_config(SHARED_BYTES)
            return kernel
    except (AttributeError, OSError, RuntimeError, TypeError) as err:
        log.warning("count_bins: NVRTC could not build the shared-memory kernel (%s); it "
                    "counts with one scatter_add", err)
        return None


def shared_counting_available(device: torch.device, n_bins: int,
                              logits_dtype: torch.dtype = torch.float32) -> bool:
    """Whether `count_bins` counts on this device in shared memory (CUDA, NVRTC present, fp32
    or bf16 logits, one expert's row fits a block)."""
    if (device.type != "cuda" or logits_dtype not in LOGIT_TYPES
            or not 0 < n_bins <= MAX_BINS):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel(index, LOGIT_TYPES[logits_dtype]) is not None


def count_bins_reference(logits: Tensor, bias: Tensor, alpha: Tensor, n_bins: int) -> Tensor:
    """logits [T, E], bias [E], alpha [T] fp32 (NaN: not counted) -> hist [E, n_bins] int32:
    `histogram.qb_histogram` of σ(logits) against the cutoffs."""
    scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    return qb_histogram(scores, alpha, bias, n_bins, valid=~torch.isnan(alpha))


@torch.library.custom_op("titan_moe::count_bins", mutates_args=())
def count_bins(logits: Tensor, bias: Tensor, alpha: Tensor, n_bins: int) -> Tensor:
    """logits [T, E], bias [E], alpha [T] fp32 (NaN: not counted) -> hist [E, n_bins] int32."""
    return count_bins_reference(logits, bias, alpha, n_bins)


@count_bins.register_fake
def _(logits: Tensor, bias: Tensor, alpha: Tensor, n_bins: int) -> Tensor:
    return logits.new_empty(logits.shape[1], n_bins, dtype=torch.int32)


@count_bins.register_kernel("cuda")
def _(logits: Tensor, bias: Tensor, alpha: Tensor, n_bins: int) -> Tensor:
    if not shared_counting_available(logits.device, n_bins, logits.dtype):
        return count_bins_reference(logits, bias, alpha, n_bins)
    kernel = _kernel(logits.device.index, LOGIT_TYPES[logits.dtype])
    n_tokens, n_experts = logits.shape
    logits = logits.contiguous()
    hist = torch.empty(n_experts, n_bins, dtype=torch.int32, device=logits.device)
    if n_experts == 0:
        return hist
    n_sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    width = experts_per_block(n_experts, n_bins, n_sms)
    kernel(grid=(-(-n_experts // width), 1, 1), block=(BLOCK_THREADS, 1, 1),
           args=[logits, bias.float().contiguous(), alpha.float().contiguous(), hist, n_tokens,
                 n_experts, n_bins, width],
           shared_mem=width * n_bins * 4)
    return hist
