"""fla-core's chunked KDA kernels as custom ops that torch.compile traces with no graph break.

fla's own `chunk_kda` is `torch.compiler.disable`d (its autograd Function launches autotuned
kernels and prepares varlen indices on the host), so a compiled model would break its graph at
every KDA layer. Here fla's forward and backward (`safe_gate=True, lower_bound=g_min`: the same
lower-bounded gate g = g_min sigmoid(exp(A_log) (g_raw + dt_bias)) as ours) are two
`torch.library.custom_op`s with fake shapes and a registered autograd, so Inductor sees one
opaque node per direction and compiles everything around it.

Documents: `doc` [B, T] (the state restarts at every change) becomes fla's varlen form, the
rows flattened to [1, B*T] with a sequence boundary at every row start and document change;
initial_state seeds each row's first document and the final state is each row's last one's.
The forward keeps only fla's chunk matrices (A_qk, A_kk) and, for a precomputed gate, the
gate's chunk cumsum; fla's backward recomputes W, U and the states from them.

fla-core is an optional dependency (`pip install -e '.[gpu]'`), imported when the op first runs.
fla autotunes each of its kernels at the first call of every new variant, minutes in all; the
configs it chose on a GPU model (`scripts/tune_fla_kda.py`) are kept in `fla_configs/<GPU>/`
and handed to fla's own config cache, so a run on that GPU starts without autotuning.
"""

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch
from torch import Tensor

from titan_moe.ops.kda.chunk_common import CHUNK
from titan_moe.ops.static_documents import cu_seqlens_from_starts, sequence_starts

FLA_INSTALL_HINT = "pip install fla-core==0.6.0 (or pip install -e '.[gpu]')"


# Looked up once: the model reads it while torch.compile traces, where no import may run.
FLA_INSTALLED = importlib.util.find_spec("fla") is not None


FLA_CONFIG_ROOT = Path(__file__).with_name("fla_configs")


def fla_config_dir(gpu_name: str) -> Path:
    """Where the tuned configs of one GPU model live (fla's own naming of the GPU)."""
    return FLA_CONFIG_ROOT / (re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu")


def use_tuned_fla_configs() -> None:
    """Point fla's config cache at our tuned configs for this GPU, if we have them.

    fla reads FLA_CACHE_MODE and FLA_CONFIG_DIR once, when its cache module is imported, so this
    runs before the first import of fla's kernels; a user's own settings win. "full": a config
    is taken for an equal autotune key, else for one of the same structure with other sizes
    (another sequence length), else each kernel's `default_config` (the one tuned for the
    model's variant). Without that last fallback, every other variant (a given gate, initial
    states: autotune keys of another length) autotuned for about 140 s at its first call
    (measured on the H200, 2026-12-04).
    """
    if "fla.ops.utils.cache" in sys.modules or "FLA_CACHE_MODE" in os.environ:
        return
    configs = fla_config_dir(torch.cuda.get_device_name())
    if configs.is_dir():
        os.environ["FLA_CACHE_MODE"] = "full"
        os.environ["FLA_CONFIG_DIR"] = str(configs)


@functools.cache
def _require_fla():
    """fla's entry points, its config and buffer setup done at the first call only (every KDA
    call of a step comes through here)."""
    if not FLA_INSTALLED:
        raise ModuleNotFoundError(f"the fla KDA backend needs fla-core: {FLA_INSTALL_HINT}")
    use_tuned_fla_configs()
    # Imported here, not at module level: fla-core is optional and pulls in its kernels.
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    _allocate_fresh_graph_buffers()
    return chunk_kda_fwd, chunk_kda_bwd


def _fresh_buffer(name: str, shape: tuple, dtype: torch.dtype, device, zero: bool = False):
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)


def _allocate_fresh_graph_buffers() -> None:
    """fla's use_graph mode (our static layout) takes its backward's scratch and gradient
    tensors from process-wide buffers, one per name and shape, made for fla's own manual graph
    capture. Under Inductor's CUDA graphs they would be allocated in the graphs' memory pool and
    kept alive untracked (cudagraph trees refuse that), and every KDA layer's gradients would
    share one buffer. Here each call allocates its own, as fla does without use_graph."""
    from fla.ops.common import chunk_delta_h
    from fla.ops.kda import chunk_bwd, chunk_intra

    for module in (chunk_bwd, chunk_intra, chunk_delta_h):
        module.get_static_buffer = _fresh_buffer


def _sequences(doc: Tensor, static: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(cu_seqlens [N+1] int32 over the flattened rows, each row's first and last sequence,
    each token's row within its chunk [B, T]: fla's chunks restart at every sequence start).
    static: cu_seqlens in fixed shapes without a host sync (ops/static_documents.py)."""
    batch, seq_len = doc.shape
    starts = sequence_starts(doc)
    cu_seqlens = cu_seqlens_from_starts(starts, static)
    seq_of_token = starts.flatten().cumsum(0) - 1
    row_first = seq_of_token[torch.arange(batch, device=doc.device) * seq_len]
    row_last = seq_of_token[torch.arange(1, batch + 1, device=doc.device) * seq_len - 1]
    t = torch.arange(seq_len, device=doc.device)
    seq_start = torch.cummax(torch.where(starts, t, 0), dim=1).values
    return cu_seqlens, row_first, row_last, (t - seq_start) % CHUNK


def _chunk_lower(a: Tensor, chunk_row: Tensor) -> Tensor:
    """fla's per-chunk matrices a [B, T, H, C] with the entries right of each row's diagonal
    zeroed. fla writes the lower triangles only and leaves the rest as `torch.empty` found it;
    zeroed, the op's outputs are defined values (opcheck compares eager and compiled outputs,
    and found such leftovers differ). chunk_row: each token's row in its chunk, [T] or [B, T]."""
    keep = chunk_row[..., None] >= torch.arange(CHUNK, device=a.device)
    return a.masked_fill_(~keep.unsqueeze(-2), 0)


# The last document layout computed, with the doc tensor it came from (held, so the object
# cannot be freed and another take its place).
_last_layout: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor, Tensor]] | None = None


def document_sequences(doc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_sequences(doc)`, reused while the same, unmodified doc tensor comes back.

    Every KDA layer of a step, forward and backward, receives the model's one doc_ids tensor,
    so the host sync of `_sequences` (its nonzero) runs once a step instead of once a call
    (48 for the proxy), and fla's own identity caches (`prepare_chunk_indices`, keyed on the
    cu_seqlens object) hit as well. Identity plus the version counter (bumped by any in-place
    write) make a stale hit impossible.
    """
    global _last_layout
    if _last_layout is not None and _last_layout[0] is doc and _last_layout[1] == doc._version:
        return _last_layout[2]
    layout = _sequences(doc)
    _last_layout = (doc, doc._version, layout)
    return layout


def _flat(x: Tensor | None, varlen: bool) -> Tensor | None:
    return x.reshape(1, -1, *x.shape[2:]) if x is not None and varlen else x


def _layout(doc: Tensor | None, static: bool) -> tuple[Tensor | None, ...]:
    if doc is None:
        return None, None, None, None
    return _sequences(doc, static=True) if static else document_sequences(doc)


def _varlen_args(cu_seqlens: Tensor | None, static: bool, total: int) -> dict:
    if cu_seqlens is None:
        return dict(cu_seqlens=None, chunk_indices=None)
    # Imported here: fla-core is optional (see _require_fla).
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_indices_static

    if not static:
        return dict(cu_seqlens=cu_seqlens, chunk_indices=prepare_chunk_indices(cu_seqlens, CHUNK))
    # Every sequence may end in a partial chunk: at most total/CHUNK + (sequences - 1) chunks.
    n_max = -(-total // CHUNK) + cu_seqlens.numel() - 2
    chunk_indices, chunk_offsets = prepare_chunk_indices_static(cu_seqlens, CHUNK, n_max)
    return dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                use_graph=True)


def _gate_args(A_log: Tensor | None, dt_bias: Tensor | None, g_min: float) -> dict:
    return dict(safe_gate=True, lower_bound=g_min, use_gate_in_kernel=A_log is not None,
                A_log=A_log, dt_bias=dt_bias)


def _per_sequence(state: Tensor, rows: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Row states [B,H,K,V] -> fla's per-sequence states [N,H,K,V], row b's at sequence rows[b]
    (its first or last one), zero elsewhere."""
    out = state.new_zeros(cu_seqlens.numel() - 1, *state.shape[1:])
    return out.index_copy(0, rows, state)


@torch.library.custom_op("titan_moe::fla_kda_fwd", mutates_args=(), device_types="cuda")
def fla_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    scale: float,
    g_min: float,
    output_final_state: bool,
    static_layout: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o like q, final [B,H,K,V] fp32 or empty, A_qk, A_kk [B,T,H,C] in k's dtype, G fp32 or
    empty: the gate's chunk cumsum, kept for the backward when the gate is precomputed).

    static_layout: the documents' layout in fixed shapes without a host sync, so a CUDA graph
    can replay the call for any documents (see _sequences); otherwise the exact layout,
    read on the host once a step (document_sequences)."""
    fwd, _ = _require_fla()
    varlen = doc is not None
    cu_seqlens, row_first, row_last, chunk_row = _layout(doc, static_layout)
    if not varlen:
        chunk_row = torch.arange(q.shape[1], device=q.device) % CHUNK
    if initial_state is not None and varlen:
        initial_state = _per_sequence(initial_state, row_first, cu_seqlens)
    o, final, g_cumsum, A_qk, A_kk, *_ = fwd(
        q=_flat(q, varlen), k=_flat(k, varlen), v=_flat(v, varlen), g=_flat(g, varlen),
        beta=_flat(beta, varlen), scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=CHUNK,
        **_varlen_args(cu_seqlens, static_layout, q.shape[0] * q.shape[1]),
        **_gate_args(A_log, dt_bias, g_min),
    )  # fmt: skip
    if output_final_state and varlen:
        final = final[row_last]
    final = final.float() if output_final_state else q.new_empty(0, dtype=torch.float32)
    g_cumsum = q.new_empty(0, dtype=torch.float32) if g_cumsum is None else g_cumsum.view(g.shape)
    A_qk, A_kk = (_chunk_lower(a.view(*k.shape[:3], CHUNK), chunk_row) for a in (A_qk, A_kk))
    return o.view(v.shape).to(q.dtype), final, A_qk, A_kk, g_cumsum


@fla_kda_fwd.register_fake
def _(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, scale, g_min, output_final_state,
      static_layout):
    batch, _, heads, d_k = q.shape
    final = (q.new_empty(batch, heads, d_k, v.shape[-1], dtype=torch.float32)
             if output_final_state else q.new_empty(0, dtype=torch.float32))
    chunk_matrix = k.new_empty(*k.shape[:3], CHUNK)
    g_cumsum = (q.new_empty(0, dtype=torch.float32) if A_log is not None
                else q.new_empty(g.shape, dtype=torch.float32))
    o = torch.empty_like(v, dtype=q.dtype)
    return o, final, chunk_matrix, torch.empty_like(chunk_matrix), g_cumsum


@torch.library.custom_op("titan_moe::fla_kda_bwd", mutates_args=(), device_types="cuda")
def fla_kda_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc: Tensor | None,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    A_qk: Tensor,
    A_kk: Tensor,
    g_cumsum: Tensor,
    do: Tensor,
    d_final: Tensor | None,
    scale: float,
    g_min: float,
    static_layout: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta in their inputs' dtypes, d initial_state, dA_log, d dt_bias; the
    last three empty where the input is absent)."""
    _, bwd = _require_fla()
    varlen = doc is not None
    fused = A_log is not None
    cu_seqlens, row_first, row_last, _ = _layout(doc, static_layout)
    h0, dht = initial_state, d_final
    if varlen:
        h0 = None if h0 is None else _per_sequence(h0, row_first, cu_seqlens)
        dht = None if dht is None else _per_sequence(dht, row_last, cu_seqlens)
    dq, dk, dv, dbeta, dg, dh0, dA_log, d_dt_bias = bwd(
        q=_flat(q, varlen), k=_flat(k, varlen), v=_flat(v, varlen), beta=_flat(beta, varlen),
        Aqk=_flat(A_qk, varlen), Akk=_flat(A_kk, varlen), scale=scale, initial_state=h0,
        do=_flat(do, varlen), dht=dht,
        g=None if fused else _flat(g_cumsum, varlen), g_org=_flat(g, varlen) if fused else None,
        chunk_size=CHUNK, **_varlen_args(cu_seqlens, static_layout, q.shape[0] * q.shape[1]),
        **_gate_args(A_log, dt_bias, g_min),
    )  # fmt: skip
    if initial_state is None:
        d_initial = q.new_empty(0, dtype=torch.float32)
    else:
        d_initial = (dh0[row_first] if varlen else dh0).to(initial_state.dtype)
    # A custom op's outputs may not alias each other: a fresh empty tensor for each absent one.
    return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype), dg.view(g.shape).to(g.dtype),
            dbeta.view(beta.shape).to(beta.dtype), d_initial,
            dA_log.to(A_log.dtype) if fused else q.new_empty(0, dtype=torch.float32),
            d_dt_bias.to(dt_bias.dtype) if fused else q.new_empty(0, dtype=torch.float32))


@fla_kda_bwd.register_fake
def _(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, A_qk, A_kk, g_cumsum, do, d_final,
      scale, g_min, static_layout):
    def like(x):
        return q.new_empty(0, dtype=torch.float32) if x is None else torch.empty_like(x)

    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), like(initial_state), like(A_log), like(dt_bias))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, doc, A_log, dt_bias, initial_state, scale, g_min, _, static_layout = inputs
    _, _, A_qk, A_kk, g_cumsum = output
    ctx.mark_non_differentiable(A_qk, A_kk, g_cumsum)
    # Else autograd fills a zero gradient for each of them at the backward's start (1 KiB a token
    # and head at K = 128, fp32), though none is read.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, doc, A_log, dt_bias, initial_state, A_qk, A_kk,
                          g_cumsum)
    ctx.scale, ctx.g_min, ctx.static_layout = scale, g_min, static_layout


def _backward(ctx, do, d_final, *_):
    q, k, v, g, beta, doc, A_log, dt_bias, initial_state, A_qk, A_kk, g_cumsum = ctx.saved_tensors
    if d_final is not None and d_final.numel() == 0:
        d_final = None
    if do is None:  # only the final state reaches the loss
        do = q.new_zeros(*q.shape[:3], v.shape[-1])
    dq, dk, dv, dg, dbeta, d_initial, dA_log, d_dt_bias = fla_kda_bwd(
        q, k, v, g, beta, doc, A_log, dt_bias, initial_state, A_qk, A_kk, g_cumsum,
        do.contiguous(), None if d_final is None else d_final.contiguous(), ctx.scale, ctx.g_min,
        ctx.static_layout,
    )  # fmt: skip
    return (dq, dk, dv, dg, dbeta, None, dA_log if A_log is not None else None,
            d_dt_bias if dt_bias is not None else None,
            d_initial if initial_state is not None else None, None, None, None, None)


fla_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    doc: Tensor | None = None,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    g_min: float = -5.0,
    static_layout: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`chunk_kda_triton`'s interface and semantics, computed by fla-core's kernels.
    static_layout: CUDA-graph-safe documents (fla_kda_fwd says how)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    o, final, _, _, _ = fla_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        None if doc is None else doc.contiguous(),
        None if A_log is None else A_log.float().contiguous(),
        None if dt_bias is None else dt_bias.float().contiguous(),
        initial_state, float(scale), float(g_min), output_final_state, static_layout,
    )  # fmt: skip
    return o, final if output_final_state else None
