"""What a Triton op allocates while it runs, counted by running its Python body with every kernel
launch skipped: the buffers are allocated exactly as on the GPU (on meta or CPU tensors) and no
kernel runs.

The memory plan needs this for the KDA op, whose backward recomputes the forward's states and
W, U (and over segments its chunk matrices, which a one-segment forward keeps) and holds them
in fp32 (W, K_d and V~ as bf16 GEMM operands) with the gradients' fp32 buffers: 5.1 kB a
token and head at K = V = 128 over a segment (chunk_triton.SEGMENT tokens), where the layer's
largest saved tensor is 2 bytes a channel.
`bench/kda_memory.py` uses the same count for its peak-memory predictions.
"""

import contextlib
import functools
import importlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The package exports the triton_ops under their modules' names: import the module by its path.
chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that op outputs made while active, alive now and at most.

    A storage counts once however many tensors view it, and stops counting when the last of
    them is freed; the storages of `ignore` (inputs made before) never count, views of them
    neither."""

    def __init__(self, ignore: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.ignore = {t.untyped_storage()._cdata for t in ignore if t is not None}
        self.views: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.views[key] -= 1
        if self.views[key] == 0:
            del self.views[key]
            self.now -= self.sizes.pop(key)

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if size == 0 or key in self.ignore:
            return
        if key not in self.views:
            self.views[key], self.sizes[key] = 0, size
            self.now += size
            self.peak = max(self.peak, self.now)
        self.views[key] += 1
        weakref.finalize(tensor, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


@contextlib.contextmanager
def kda_launches_skipped() -> Iterator[None]:
    """The KDA op's kernel launches (through wrap_triton) return without running."""
    def skip(*args, **kwargs):
        return None

    class Skip:
        def __init__(self, kernel):
            pass

        def __getitem__(self, grid):
            return skip

    original = chunk_triton.wrap_triton
    chunk_triton.wrap_triton = Skip
    try:
        yield
    finally:
        chunk_triton.wrap_triton = original


def kda_kept_matrices(batch: int, seq_len: int, heads: int,
                      device: torch.device | str = "meta") -> tuple[torch.Tensor, ...]:
    """The chunk matrices (A_qk, KK, Tinv, fp32) the KDA op's forward keeps for its backward
    when a backward will run; none for a sequence over chunk_triton.SEGMENT tokens, whose
    backward recomputes them segment by segment."""
    if seq_len > chunk_triton.SEGMENT:
        return ()
    padded = -(-seq_len // chunk_triton.CHUNK) * chunk_triton.CHUNK
    return tuple(torch.empty(batch, padded, heads, chunk_triton.CHUNK, dtype=torch.float32,
                             device=device) for _ in range(3))


@functools.cache
def kda_backward_workspace(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
                           fused_gate: bool = True) -> int:
    """Peak bytes the KDA op's backward holds besides its inputs and the chunk matrices its
    forward kept (kda_kept_matrices: saved, so the plan counts them with the layer's saves): dO,
    the recomputed fp32 buffers, the gradients' buffers and the gradients it returns (bf16
    inputs, as in training)."""
    with torch.device("meta"):
        q, k, g = (torch.empty(batch, seq_len, heads, d_k, dtype=torch.bfloat16)
                   for _ in range(3))
        v = torch.empty(batch, seq_len, heads, d_v, dtype=torch.bfloat16)
        beta = torch.empty(batch, seq_len, heads, dtype=torch.bfloat16)
        gate = (torch.empty(heads), torch.empty(heads * d_k)) if fused_gate else (None, None)
        kept = kda_kept_matrices(batch, seq_len, heads)
        tracker = LiveBytes(ignore=(q, k, v, g, beta, *gate, *kept))
        with kda_launches_skipped(), tracker:
            do = torch.empty_like(v)
            grads = chunk_triton.chunk_kda_bwd._init_fn(q, k, v, g, beta, None, *gate, None, do,
                                                        None, d_k**-0.5, -5.0, *kept)
            del do, grads
    return tracker.peak
