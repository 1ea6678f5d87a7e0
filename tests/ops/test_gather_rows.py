"""gather_distinct_rows against index_select (the reference: same forward, index_add backward),
in float64, eager and compiled (fullgraph). Exact: each output row is one input row, and each
input row receives at most one gradient row, so no sum is reordered."""

import torch

from titan_moe.ops.gather_rows import gather_distinct_rows


def _case(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 7, dtype=dtype, generator=g)
    index = torch.randperm(50, generator=g)[:31]  # distinct rows; 19 rows never picked
    grad = torch.randn(31, 7, dtype=dtype, generator=g)
    return x, index, grad


def _value_and_grad(fn, x, index, grad):
    x = x.clone().requires_grad_()
    out = fn(x, index)
    out.backward(grad)
    return out.detach(), x.grad


def test_matches_index_select_forward_and_backward():
    x, index, grad = _case()
    want = _value_and_grad(lambda a, i: a.index_select(0, i), x, index, grad)
    got = _value_and_grad(gather_distinct_rows, x, index, grad)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    unpicked = torch.ones(50, dtype=torch.bool)
    unpicked[index] = False
    assert torch.all(got[1][unpicked] == 0)  # rows no entry picks get exactly zero


def test_compiles_fullgraph_and_matches_eager():
    x, index, grad = _case(torch.float32)
    eager = _value_and_grad(gather_distinct_rows, x, index, grad)
    compiled = _value_and_grad(torch.compile(gather_distinct_rows, fullgraph=True), x, index,
                               grad)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)
