"""count_bins' reference (the op's CPU implementation) against a loop over (token, expert), and
the op's schema and fake implementation. The CUDA kernel is compared with this reference on the
GPU (tests/gpu/test_router_cuda.py). Counts are integers: equality is exact."""

import pytest
import torch

from titan_moe.ops.router.bin_counts import count_bins, count_bins_reference, experts_per_block


def _loop(bins: torch.Tensor, n_bins: int) -> torch.Tensor:
    hist = torch.zeros(bins.shape[1], n_bins, dtype=torch.int32)
    for row in bins.tolist():
        for e, b in enumerate(row):
            if b >= 0:
                hist[e, b] += 1
    return hist


@pytest.mark.parametrize(("n_tokens", "n_experts", "n_bins"), [(50, 7, 13), (1, 3, 1), (0, 4, 5)])
def test_reference_equals_loop(n_tokens, n_experts, n_bins):
    gen = torch.Generator().manual_seed(n_tokens)
    bins = torch.randint(-1, n_bins, (n_tokens, n_experts), generator=gen, dtype=torch.int16)
    want = _loop(bins, n_bins)
    assert torch.equal(count_bins_reference(bins, n_bins), want)
    assert torch.equal(count_bins(bins, n_bins), want)
    assert count_bins(bins, n_bins).sum().item() == int((bins >= 0).sum())


def test_opcheck():
    bins = torch.randint(-1, 9, (20, 5), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int16)
    torch.library.opcheck(count_bins, (bins, 9),
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
    routing kernel writing bins, then count_bins on them, in one full graph."""
    import importlib

    from torch._dynamo.backends.common import aot_autograd

    module = importlib.import_module("titan_moe.ops.router.qb_route_triton")
    monkeypatch.setattr(module, "DEFAULT_COUNTING", "shared")
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Traced

        return run

    torch._dynamo.reset()
    fn = torch.compile(lambda logits, bias: module.qb_route_triton(logits, bias, None, 3, 1.0, 50,
                                                                   True),
                       backend=aot_autograd(fw_compiler=fw_compiler), fullgraph=True)
    with pytest.raises(_Traced):
        fn(torch.randn(37, 12), torch.zeros(12))
    (graph,) = graphs
    nodes = [(str(n.target), n) for n in graph.graph.nodes if n.op == "call_function"]
    kernel = next(n for name, n in nodes if "triton_kernel_wrapper" in name)
    counts = next(n for name, n in nodes if name == "titan_moe.count_bins.default")
    assert kernel.kwargs["kwargs"]["WITH_HIST"] and kernel.kwargs["kwargs"]["WRITE_BINS"]
    assert counts.args[0].args[0] is kernel and counts.args[0].args[1] == "bins_ptr"
    torch._dynamo.reset()
