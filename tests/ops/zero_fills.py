"""Recording the tensors that aten ops fill with zeros, e.g. during a backward: autograd fills a
zero gradient for each output of a custom op that got none (kept buffers, statistics) unless
the op's context turns `set_materialize_grads` off."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ZERO_OPS = ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like")


class ZeroFills(TorchDispatchMode):
    """Every tensor a zero-filling aten op returns while active, as (op, shape, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.fills: list[tuple[str, list[int], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ZERO_OPS and isinstance(out, torch.Tensor):
            self.fills.append((func.overloadpacket.__name__, list(out.shape), str(out.dtype)))
        return out
