"""The split-KV MLA decode op (titan_moe/ops/mla_decode.py) under the Triton interpreter (CPU).

Reference: `mla_decode_attention_naive` in float64 (fp32 scores, masked softmax, p @ values),
itself checked against the model's full forward through tests/generate/test_static_decode.py.
The op's combine of per-split partial softmaxes is exact up to fp32 rounding: tolerance 1e-5
of the largest output. Cases: ragged valid slots, garbage in the unwritten slots past pos, a row
that sees only its own slot, more heads than one head block, non-power-of-two widths, several
splits a row with several blocks each (the interpreter's grid is sized as for 8 SMs).
"""

import json
import os
import sys

import pytest
import torch

from tests.ops.interpreter import guarded
from titan_moe.ops.mla_decode import mla_decode_attention_naive, split_layout

FP32_RTOL = 1e-5
# name: (batch, heads, slots, lora, rope, pos)
CASES = {
    "tiny": (2, 2, 100, 16, 8, 70),
    "two_head_blocks": (3, 20, 300, 32, 16, 299),
    "odd_widths": (2, 5, 130, 24, 8, 64),
    "proxy_widths": (1, 16, 1000, 256, 64, 777),
    "blocks_a_split": (4, 16, 2600, 32, 16, 2500),  # 8 splits of 6 blocks, the last empty
    "empty_splits": (1, 2, 200, 16, 8, 150),  # 32 splits of one block, 28 of them empty
}


def make_inputs(batch, heads, slots, lora, rope, pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lora + rope, generator=g)
    kv = torch.randn(batch, slots, lora + rope, generator=g)  # past pos: garbage, never valid
    valid = torch.rand(batch, slots, generator=g) > 0.3
    valid[:, pos + 1 :] = False
    if batch > 1:
        valid[1] = False  # row 1 sees its own slot only
    return q, kv, valid, torch.tensor(pos)


def run_case(batch, heads, slots, lora, rope, pos) -> dict:
    from titan_moe.ops.mla_decode import mla_decode_triton

    q, kv, valid, p = make_inputs(batch, heads, slots, lora, rope, pos)
    got = mla_decode_triton(q, kv, valid, p, 0.3, lora)
    want = mla_decode_attention_naive(q.double(), kv.double(), valid, p, 0.3, lora)
    err = float((got.double() - want).abs().max() / want.abs().max())
    return {"err": err, "shape": list(got.shape), "dtype": str(got.dtype)}


def run_opcheck() -> dict:
    from titan_moe.ops.mla_decode import mla_decode_triton

    q, kv, valid, p = make_inputs(2, 3, 100, 16, 8, 70)
    # Fake-tensor and AOT checks need the compiled kernel (the interpreter reads the fake
    # tensors' storage): tests/gpu/test_static_decode_cuda.py runs them on CUDA.
    tests = ("test_schema",)
    return {name: str(result) for name, result in
            torch.library.opcheck(mla_decode_triton, (q, kv, valid, p, 0.3, 16),
                                  test_utils=tests).items()}


@pytest.mark.parametrize("name", CASES)
def test_op_matches_float64_reference_under_interpreter(results, name):
    report = results[name]
    assert "error" not in report, report["error"]
    batch, heads, _, lora, _, _ = CASES[name]
    assert report["shape"] == [batch, heads, lora] and report["dtype"] == "torch.float32"
    assert report["err"] <= FP32_RTOL, report["err"]


def test_opcheck_schema_fake_and_aot(results):
    """The op's schema (its fake implementation and AOT tracing: the CUDA test)."""
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


def test_splits_cover_every_slot_in_whole_blocks_and_their_count_ignores_the_length():
    for batch, heads, slots in [(1, 16, 1000), (8, 16, 524360), (3, 20, 300), (64, 2, 64)]:
        splits, split_len = split_layout(batch, heads, slots, torch.device("cpu"))
        assert split_len % 64 == 0 and splits * split_len >= slots
        assert (split_len - 64) * splits < slots  # the shortest whole-block split that covers
        assert split_layout(batch, heads, 7 * slots + 1, torch.device("cpu"))[0] == splits


class _Traced(Exception):
    """Raised in place of running the traced graph: CPU tensors cannot run the Triton kernel."""


def test_one_graph_serves_caches_of_every_length_with_static_partials():
    """torch.compile with a dynamic slot count traces the op once for caches whose split
    lengths differ (the split length is an expression of the slot count, a runtime kernel
    argument, not a guard on it): six lengths over four split lengths, one graph. Traced by
    AOTAutograd as Inductor receives it (not run: CPU tensors cannot run the kernel), the
    buffers the kernel writes have static shapes: symbolic ones, mutated by the kernel and then
    sliced, stopped torch 2.11's Inductor (pytorch#189271) on the proxy's decode at batch 1."""
    from torch._dynamo.backends.common import aot_autograd

    from titan_moe.ops.mla_decode import mla_decode_triton

    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Traced

        return run

    torch._dynamo.reset()
    decode = torch.compile(lambda q, kv, valid, pos: mla_decode_triton(q, kv, valid, pos, 0.3, 16),
                           backend=aot_autograd(fw_compiler=fw_compiler), fullgraph=True)
    lengths = (1000, 2600, 300, 200, 5000, 100000)
    layouts = {split_layout(2, 3, n, torch.device("cpu"))[1] for n in lengths}
    assert len(layouts) == 4, layouts
    for slots in lengths:
        kv, valid = torch.randn(2, slots, 24), torch.ones(2, slots, dtype=torch.bool)
        torch._dynamo.mark_dynamic(kv, 1)
        torch._dynamo.mark_dynamic(valid, 1)
        with pytest.raises(_Traced):
            decode(torch.randn(2, 3, 24), kv, valid, torch.tensor(5))
    assert len(graphs) == 1, len(graphs)
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    kernel = next(n for n in nodes if "triton_kernel_wrapper" in str(n.target))
    written = [kernel.kwargs["kwargs"][name] for name in ("m_ptr", "l_ptr", "acc_ptr")]
    for buffer in written:
        assert all(isinstance(d, int) for d in buffer.meta["val"].shape), buffer.meta["val"].shape
    assert any(not isinstance(d, int) for d in kernel.kwargs["kwargs"]["kv_ptr"].meta["val"].shape)


def test_naive_row_with_only_its_own_slot_returns_that_value():
    q, kv, valid, p = make_inputs(2, 3, 50, 16, 8, 20)
    out = mla_decode_attention_naive(q, kv, valid, p, 0.3, 16)
    torch.testing.assert_close(out[1], kv[1, 20, :16].expand(3, 16), rtol=0, atol=0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    reports = {name: guarded(run_case, *case) for name, case in CASES.items()}
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck)}))
