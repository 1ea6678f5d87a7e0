"""titan_moe.ops.direct_call on a toy op (CPU): eagerly the body runs in the direct autograd
Function, with the op's registered gradient; traced (torch.compile's AOT, make_fx) the op runs
and the body never does. Reference: the op itself, eager."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from titan_moe.ops.direct_call import direct_call

CALLS: list[str] = []


def _cube(x: torch.Tensor) -> torch.Tensor:
    CALLS.append("body")
    return x**3


@torch.library.custom_op("titan_moe_test::cube", mutates_args=())
def cube_op(x: torch.Tensor) -> torch.Tensor:
    CALLS.append("op")
    return x**3


@cube_op.register_fake
def _(x):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 3 * x**2


cube_op.register_autograd(_backward, setup_context=_setup_context)
cube = direct_call(cube_op, _cube, _setup_context, _backward)


def test_eager_call_runs_the_body_with_the_ops_gradient():
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    y = cube(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert CALLS == ["body"]
    assert type(y.grad_fn).__name__ == "_cube_directBackward"
    x_op = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(cube_op(x_op).sum(), x_op)
    torch.testing.assert_close(y, x_op**3, rtol=0, atol=0)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_traced_calls_take_the_op():
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    graph = make_fx(lambda t: cube(t))(x.detach())
    assert "titan_moe_test.cube" in graph.code and "body" not in CALLS
    compiled = torch.compile(lambda t: cube(t), backend="aot_eager", fullgraph=True)
    CALLS.clear()
    (grad,) = torch.autograd.grad(compiled(x).sum(), x)
    assert "body" not in CALLS and "op" in CALLS
    torch.testing.assert_close(grad, 3 * x.detach() ** 2)


def test_setup_context_without_backward_is_refused():
    with pytest.raises(ValueError, match="setup_context and backward together"):
        direct_call(cube_op, _cube, _setup_context)
