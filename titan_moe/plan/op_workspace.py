"""What a Triton op allocates while it runs, counted by running its Python body with every kernel
launch skipped: the buffers are allocated exactly as on the GPU (on meta or CPU tensors) and no
kernel runs.

The memory plan needs this for MLA's attention by key segments (its backward's Flash path on
meta, mla_key_segment_backward_workspace), for an AttnRes site's backward
(attn_res_backward_workspace) and for the KDA op. On a sequence of one segment the
KDA forward keeps what the backward reads (chunk matrices and G in fp32; W, K_d, the chunk-entry
states and V~ as bf16 GEMM operands): 2,560 B a token and head at K = V = 128, saved with the
layer's other tensors, where the layer's largest activation is 2 bytes a channel. Its backward
frees those as it goes and adds the gradients' buffers (fp32, but the state gradients bf16 and
freed with the states, before the peak), 2,860 B more at its peak (tile_products_bwd's
launch); by segments (chunk_triton.SEGMENT tokens) the forward keeps
nothing and the backward recomputes each segment's, 5,420 B over a segment at its peak.
`bench/kda_memory.py` uses the same count for its peak-memory predictions.
"""

import contextlib
import functools
import importlib
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The package exports the triton_ops under their modules' names: import the module by its path.
chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")
attn_res_triton = importlib.import_module("titan_moe.ops.attn_res.attn_res_triton")


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
def launches_skipped(module) -> Iterator[None]:
    """The kernel launches of `module` (an ops module, through its wrap_triton) return without
    running."""
    def skip(*args, **kwargs):
        return None

    class Skip:
        def __init__(self, kernel):
            pass

        def __getitem__(self, grid):
            return skip

    original = module.wrap_triton
    module.wrap_triton = Skip
    try:
        yield
    finally:
        module.wrap_triton = original


def kda_launches_skipped() -> contextlib.AbstractContextManager[None]:
    """The KDA op's kernel launches return without running."""
    return launches_skipped(chunk_triton)


@contextlib.contextmanager
def op_bodies(module, names: tuple[str, ...]) -> Iterator[None]:
    """The triton_ops `names` of `module`, as the module's own code calls them, run their Python
    bodies directly: a custom op's body is hidden from a dispatch mode, and meta tensors have no
    kernel to dispatch to."""
    ops = {name: getattr(module, name) for name in names}
    try:
        for name, op in ops.items():
            setattr(module, name, op._init_fn)
        yield
    finally:
        for name, op in ops.items():
            setattr(module, name, op)


def kda_backward_bodies() -> contextlib.AbstractContextManager[None]:
    """The KDA op's backward triton_ops, as `chunk_triton._backward` calls them, run their
    Python bodies directly."""
    return op_bodies(chunk_triton, ("chunk_kda_bwd", "chunk_kda_bwd_states",
                                    "chunk_kda_bwd_state_terms", "chunk_kda_bwd_intra"))


def kda_backward(saved: tuple, kept: list[torch.Tensor] | None, do: torch.Tensor, scale: float,
                 g_min: float = -5.0) -> tuple:
    """`chunk_triton._backward` as autograd runs it after the forward saved `saved` (q, k, v,
    g, beta, doc, A_log, dt_bias, initial_state) and kept `kept` (the forward's outputs after
    o and the final state, emptied as the backward frees each; none or empty ones: recomputed),
    with the backward ops' Python bodies called directly (kda_backward_bodies)."""
    kept = kept if kept and kept[0].numel() else None
    ctx = SimpleNamespace(saved_tensors=saved, kept=kept, scale=scale, g_min=g_min)
    with kda_backward_bodies():
        return chunk_triton._backward(ctx, do, None)


def _kda_inputs(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
                fused_gate: bool) -> tuple:
    """(q, k, v, g, beta, A_log, dt_bias) on meta, bf16 as in training."""
    with torch.device("meta"):
        q, k, g = (torch.empty(batch, seq_len, heads, d_k, dtype=torch.bfloat16)
                   for _ in range(3))
        v = torch.empty(batch, seq_len, heads, d_v, dtype=torch.bfloat16)
        beta = torch.empty(batch, seq_len, heads, dtype=torch.bfloat16)
        gate = (torch.empty(heads), torch.empty(heads * d_k)) if fused_gate else (None, None)
    return q, k, v, g, beta, *gate


def kda_kept_buffers(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
                     device: torch.device | str = "meta") -> tuple[torch.Tensor, ...]:
    """What the KDA op's forward keeps for its backward when a backward will run
    (chunk_triton.KEPT, bf16 inputs), as its body allocates them: none for a sequence over
    chunk_triton.SEGMENT tokens, whose backward recomputes them segment by segment."""
    q, k, v, g, beta, A_log, dt_bias = _kda_inputs(batch, seq_len, heads, d_k, d_v, True)
    with kda_launches_skipped():
        kept = chunk_triton.chunk_kda_fwd._init_fn(q, k, v, g, beta, None, A_log, dt_bias, None,
                                                   d_k**-0.5, -5.0, False, True)[2:]
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in kept if t.numel())


@functools.cache
def kda_backward_workspace(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
                           fused_gate: bool = True) -> int:
    """Peak bytes the KDA op's backward holds besides its inputs and the buffers its forward
    kept (kda_kept_buffers: saved, so the plan counts them with the layer's saves; the
    backward frees each after its last reader, and what it has freed by its peak is subtracted
    here): dO, the recomputed fp32 buffers, the gradients' buffers and the gradients it returns
    (bf16 inputs, as in training). It runs as autograd runs it (chunk_triton._backward)."""
    q, k, v, g, beta, A_log, dt_bias = _kda_inputs(batch, seq_len, heads, d_k, d_v, fused_gate)
    tracker = LiveBytes(ignore=(q, k, v, g, beta, A_log, dt_bias))
    with kda_launches_skipped(), tracker:
        kept = list(kda_kept_buffers(batch, seq_len, heads, d_k, d_v))
        tracker.peak = kept_bytes = tracker.now  # the kept buffers alone: the forward has run
        do = torch.empty_like(v)
        grads = kda_backward((q, k, v, g, beta, None, A_log, dt_bias, None), kept, do,
                             d_k**-0.5)
        del do, grads
    return tracker.peak - kept_bytes


@functools.cache
def attn_res_backward_workspace(rows: int, dim: int, dtypes: tuple[torch.dtype, ...],
                                out_dtype: torch.dtype) -> int:
    """Peak bytes an AttnRes site's backward holds besides its saved sources and stats, for
    sources of `dtypes` ([rows, dim] each) and an output in out_dtype: the gradient of its output
    (in out_dtype, the site's dtype, read by the op as it comes: while the site cast an fp32
    output, autograd made an fp32 copy of it) and what the op's backward allocates as autograd
    runs it (attn_res_triton._backward): the n source gradients, returned together, u and the du
    partial sums. Its body runs on meta with the kernel launch skipped. n gradients at once make
    it the largest transient of a late layer in a long step: at 512K on the proxy (H100) each
    layer's backward rose about one [T, d] bf16 tensor more per source its sites read."""
    with torch.device("meta"):
        sources = [torch.empty(rows, dim, dtype=dtype) for dtype in dtypes]
        stats = torch.empty(3, len(dtypes), rows)
        query, gain = torch.empty(dim), torch.empty(dim)
        grad = torch.empty(rows, dim, dtype=out_dtype)
    ctx = SimpleNamespace(saved_tensors=(*sources, stats, query, gain))
    tracker = LiveBytes(ignore=(*sources, stats, query, gain, grad))
    with launches_skipped(attn_res_triton), op_bodies(attn_res_triton, ("attn_res_bwd",)), tracker:
        grads = attn_res_triton._backward(ctx, grad, None)
        del grads
    return tracker.peak + grad.nbytes


@functools.cache
def mla_key_segment_backward_workspace(batch: int, queries: int, keys: int, key_segment: int,
                                       heads: int, qk: int, v_dim: int, kv_lora: int,
                                       rope: int) -> int:
    """Peak bytes MLA's attention by key segments (ops/key_segment_attention.py, its latent
    projection and Flash's path, bf16) holds in its backward besides its saved tensors and dO:
    the fp32 dq, one key segment's up-projection, its rows as Flash takes them (v, o and dO
    padded to qk, q and k gathered: every row taking part), Flash's gradients and their scatter,
    the projection's backward, and the latents' gradient growing over the keys (then joined).
    Its body runs on meta with Flash's meta kernels; Flash's own fp32 dq accumulator (4 bytes a
    query, head and qk channel), invisible there, is added."""
    segment_pairs = importlib.import_module("titan_moe.ops.segment_pair_attention")
    key_attention = importlib.import_module("titan_moe.ops.key_segment_attention")
    latent_keys = importlib.import_module("titan_moe.ops.mla_latent_keys")
    nope = qk - rope
    with torch.device("meta"):
        q = torch.empty(batch, queries, heads, qk, dtype=torch.bfloat16)
        o = torch.empty(batch, queries, heads, v_dim, dtype=torch.bfloat16)
        do = torch.empty_like(o)
        lse = torch.empty(batch, queries, heads, dtype=torch.float32)
        c_kv = torch.empty(batch, keys, kv_lora, dtype=torch.bfloat16)
        k_rope = torch.empty(batch, keys, rope, dtype=torch.bfloat16)
        norm = torch.empty(kv_lora, dtype=torch.float32)
        w_kvb = torch.empty(heads * (nope + v_dim), kv_lora, dtype=torch.bfloat16)
        ctx = _Context(saved_tensors=(q, None, None, o, lse, c_kv, k_rope, norm, w_kvb),
                       projection=latent_keys.LatentKeys, options=(heads, nope, 1e-6),
                       key_segment=key_segment, scale=qk**-0.5, n_inputs=2)
        tracker = LiveBytes(ignore=(q, o, do, lse, c_kv, k_rope, norm, w_kvb))
        with _every_row_through_flash(segment_pairs), tracker:
            grads = key_attention._KeySegmentAttention.backward(ctx, do)
            del grads
    return tracker.peak + 4 * batch * queries * heads * qk


class _Context:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


@contextlib.contextmanager
def _every_row_through_flash(segment_pairs) -> Iterator[None]:
    """Flash's path on meta: every row of every pair takes part, gathered as a copy off the
    diagonal (the layout's boolean masks would read the host)."""
    class Layout:
        def __init__(self, q_doc, kv_doc, batch, queries, length, diagonal, device):
            self.causal, self.empty = diagonal, False
            self.q_rows = self.k_rows = None
            self.cu_q = self.cu_k = torch.empty(batch + 1, dtype=torch.int32)
            self.max_q, self.max_k = queries, length

        def rows(self, x, mask):
            rows = x.flatten(0, 1)
            return rows if self.causal else rows.clone()

        def scatter(self, rows, mask, shape, fill, dtype):
            if self.causal:  # all rows in order: the real layout's view (a cast at most)
                return rows.to(dtype).view(shape)
            out = torch.full(shape, fill, dtype=dtype)
            out.view(-1, *shape[2:]).copy_(rows)
            return out

    original = (segment_pairs._Layout, segment_pairs.flash_eligible)
    segment_pairs._Layout, segment_pairs.flash_eligible = Layout, lambda q: True
    try:
        yield
    finally:
        segment_pairs._Layout, segment_pairs.flash_eligible = original
