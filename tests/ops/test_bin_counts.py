"""count_bins' reference (the op's CPU implementation) against NumPy's fp32 arithmetic over
every (token, expert), and the op's schema and fake implementation. The CUDA kernel is compared
with this reference on the GPU (tests/gpu/test_router_cuda.py). Counts are integers: equality is
exact."""

import importlib

import numpy as np
import pytest
import torch

from tests.ops.fp32_histogram import fp32_histogram
from titan_moe.ops.router.bin_counts import count_bins, count_bins_reference, experts_per_block

# The module, not the op of the same name that titan_moe.ops.router exports.
qb_route_module = importlib.import_module("titan_moe.ops.router.qb_route_triton")


def _numpy_counts(logits: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
                  n_bins: int) -> np.ndarray:
    """The bins in fp32, one IEEE operation at a time, on the same scores (σ is torch's)."""
    a = alpha.numpy()
    return fp32_histogram(torch.sigmoid(logits.float()).numpy(), a, bias.numpy(), n_bins,
                          counted=~np.isnan(a))


@pytest.mark.parametrize(("n_tokens", "n_experts", "n_bins"), [(500, 7, 13), (1, 3, 1), (0, 4, 5)])
def test_reference_equals_numpy(n_tokens, n_experts, n_bins):
    gen = torch.Generator().manual_seed(n_tokens)
    logits = 2 * torch.randn(n_tokens, n_experts, generator=gen)
    bias = 0.1 * torch.randn(n_experts, generator=gen)
    alpha = torch.sigmoid(logits).max(1).values if n_tokens else torch.zeros(0)
    alpha[::3] = float("nan")  # tokens not counted
    want = _numpy_counts(logits, bias, alpha, n_bins)
    assert np.array_equal(count_bins_reference(logits, bias, alpha, n_bins).numpy(), want)
    assert np.array_equal(count_bins(logits, bias, alpha, n_bins).numpy(), want)
    assert count_bins(logits, bias, alpha, n_bins).sum().item() == n_experts * int(
        (~torch.isnan(alpha)).sum())


def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(20, 5, generator=gen), torch.randn(5, generator=gen)
    alpha = torch.rand(20, generator=gen)
    torch.library.opcheck(count_bins, (logits, bias, alpha, 9),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(("n_experts", "n_bins", "n_sms", "want"),
                         [(896, 1000, 132, 7), (64, 1000, 132, 1), (4096, 1000, 132, 12),
                          (10, 12288, 132, 1)])
def test_experts_per_block_fills_the_sms_within_shared_memory(n_experts, n_bins, n_sms, want):
    width = experts_per_block(n_experts, n_bins, n_sms)
    assert width == want
    assert width * n_bins * 4 <= 48 * 1024


class _Traced(Exception):
    """Raised in place of running the traced graph: CPU tensors cannot run the Triton kernel."""


def test_routing_op_traces_to_the_kernel_then_count_bins(monkeypatch):
    """What Inductor compiles on CUDA (forced here on CPU tensors, traced but not run): the
    routing kernel writing the cutoffs, then count_bins on them, in one full graph."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(qb_route_module, "default_counting", lambda logits, n_bins: "shared")
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Traced

        return run

    torch._dynamo.reset()
    def route(logits, bias):
        return qb_route_module.qb_route_triton(logits, bias, None, 3, 1.0, 50, True)

    fn = torch.compile(route, backend=aot_autograd(fw_compiler=fw_compiler), fullgraph=True)
    with pytest.raises(_Traced):
        fn(torch.randn(37, 12), torch.zeros(12))
    (graph,) = graphs
    nodes = [(str(n.target), n) for n in graph.graph.nodes if n.op == "call_function"]
    kernel = next(n for name, n in nodes if "triton_kernel_wrapper" in name)
    counts = next(n for name, n in nodes if name == "titan_moe.count_bins.default")
    assert kernel.kwargs["kwargs"]["WITH_HIST"] and kernel.kwargs["kwargs"]["WRITE_ALPHA"]
    assert counts.args[2].args[0] is kernel and counts.args[2].args[1] == "alpha_ptr"
    torch._dynamo.reset()


@pytest.mark.parametrize(("n_tokens", "n_experts", "available", "want"), [
    (16384, 896, True, "shared"),  # 14.7M pairs: issue 20's shape
    (4096, 1024, True, "shared"),  # exactly 2^22
    (4095, 1024, True, "atomic"),  # one token short
    (16384, 128, True, "atomic"),  # bench/moe.py's d 512 layer: 2.1M pairs, host-bound
    (16384, 896, False, "atomic"),  # no shared-memory kernel (CPU, or NVRTC missing)
])
def test_default_counting_is_shared_from_the_threshold_where_the_kernel_exists(
        monkeypatch, n_tokens, n_experts, available, want):
    """The rule against its statement: shared from 2^22 (token, expert) pairs where count_bins
    has its kernel (availability asked for the logits' device and dtype), atomics otherwise."""
    asked = []

    def availability(device, n_bins, dtype):
        asked.append((device.type, n_bins, dtype))
        return available

    monkeypatch.setattr(qb_route_module, "shared_counting_available", availability)
    logits = torch.empty(n_tokens, n_experts, device="meta")
    assert qb_route_module.SHARED_COUNTING_MIN_COUNTS == 2**22
    assert qb_route_module.default_counting(logits, 1000) == want
    assert all(a == ("meta", 1000, torch.float32) for a in asked)


def test_op_counts_by_the_default_rule_and_not_without_a_histogram(monkeypatch):
    """launch_qb_route with counting None: the rule's choice decides whether the kernel writes
    cutoffs for count_bins (the launch recorded, not run: CPU tensors); without a histogram
    nothing is counted, whatever the rule says."""
    launches, counted = [], []

    class AnyGrid(dict):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs["WRITE_ALPHA"])

    monkeypatch.setattr(qb_route_module, "wrap_triton", lambda kernel: AnyGrid())
    monkeypatch.setattr(qb_route_module, "count_bins", lambda *args: counted.append(args[3]))
    logits, bias = torch.randn(37, 12), torch.zeros(12)
    for choice in ("atomic", "shared"):
        monkeypatch.setattr(qb_route_module, "default_counting", lambda logits, n_bins, c=choice: c)
        qb_route_module.launch_qb_route(logits, bias, None, 3, 1.0, 50, True)
        qb_route_module.launch_qb_route(logits, bias, None, 3, 1.0, 50, False)
    assert launches == [False, False, True, False]
    assert counted == [50]
