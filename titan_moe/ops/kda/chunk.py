"""The KDA training entry points, `chunk_kda` and `chunk_kda_fused_gate` (fla's layout and
semantics), and the choice of their CUDA backend.

On CUDA they run one of two backends that torch.compile traces with no graph break:
`"triton"`, our Triton op (`chunk_triton.py`), or `"fla"`, fla-core's kernels behind custom ops
(`fla_backend.py`); `"auto"` takes ours, the faster of the two in the compiled training
step and at each shape of `bench/kda.py`. Elsewhere, and for the cases the ops leave out, the
plain-PyTorch chunked form (`naive.py`). The branch is on the device, in Python, before any op
is called: Inductor cannot compile user Triton kernels for CPU tensors.
"""

import functools

import torch
from torch import Tensor

from titan_moe.ops.kda.chunk_common import CHUNK as CHUNK_SIZE
from titan_moe.ops.kda.chunk_triton import chunk_kda_triton
from titan_moe.ops.kda.fla_backend import FLA_INSTALL_HINT, FLA_INSTALLED, chunk_kda_fla
from titan_moe.ops.kda.gate import kda_gate
from titan_moe.ops.kda.naive import chunk_kda_torch
from titan_moe.ops.kda.varlen import doc_index_from_cu_seqlens

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KDA_BACKENDS = ("auto", "triton", "fla")


def resolve_backend(backend: str) -> str:
    """"triton" or "fla" for a CUDA call; raises for an unknown name or fla without fla-core.

    "auto" is ours: the compiled proxy step on the H200 (bench/RESULTS.md, 2026-12-05, batch
    2 x 4096, compiled+passes) took 194.9 ms with ours against 205.4 ms with fla's kernels, and
    bench/kda.py has ours at 1.04-1.18x fla's forward + backward at the five shapes of issue 19.
    """
    if backend not in KDA_BACKENDS:
        raise ValueError(f"KDA backend {backend!r}: allowed {', '.join(KDA_BACKENDS)}")
    if backend == "auto":
        return "triton"
    if backend == "fla" and not FLA_INSTALLED:
        raise ModuleNotFoundError(f"KDA backend 'fla' needs fla-core: {FLA_INSTALL_HINT}")
    return backend


def _cuda_kernels(backend: str, static_layout: bool = False):
    # Our op reads the documents on the device already; fla's takes them in fixed shapes on ask.
    if resolve_backend(backend) == "fla":
        return functools.partial(chunk_kda_fla, static_layout=static_layout)
    return chunk_kda_triton


def _use_triton(q: Tensor, cu_seqlens: Tensor | None, initial_state: Tensor | None,
                output_final_state: bool) -> bool:
    # Per-document initial and final states of cu_seqlens need per-document gathers inside a
    # chunk that the op does not do; those (inference-side) calls take the PyTorch path.
    per_doc_states = cu_seqlens is not None and (initial_state is not None or output_final_state)
    return q.is_cuda and q.dtype in _TRITON_DTYPES and not per_doc_states


def _documents(q: Tensor, cu_seqlens: Tensor | None, doc_ids: Tensor | None) -> Tensor | None:
    if cu_seqlens is not None:
        return doc_index_from_cu_seqlens(cu_seqlens, q.shape[1])[None]
    return doc_ids


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    doc_ids: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA with chunk_kda_torch's signature and semantics (fla layout, scale applied);
    `backend` picks the CUDA kernels (KDA_BACKENDS)."""
    # The chunk math is fp32 by design (the gate's exponent range); AMP must not recast it.
    with torch.autocast(q.device.type, enabled=False):
        if _use_triton(q, cu_seqlens, initial_state, output_final_state):
            return _cuda_kernels(backend)(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, doc=_documents(q, cu_seqlens, doc_ids),
            )  # fmt: skip
        return chunk_kda_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, doc_ids=doc_ids,
            chunk_size=CHUNK_SIZE,
        )  # fmt: skip


def chunk_kda_fused_gate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_raw: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    beta: Tensor,
    g_min: float = -5.0,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    doc_ids: Tensor | None = None,
    backend: str = "auto",
    static_layout: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """chunk_kda with g = g_min sigmoid(exp(A_log) (g_raw + dt_bias)) computed by the kernels.

    g_raw [B,T,H,K], A_log [H], dt_bias [H*K]; on CUDA the gate, its chunk-local cumsum and
    their gradients never leave the Triton kernels. static_layout: the documents in fixed shapes
    with no host sync, replayable as a CUDA graph (fla_backend.fla_kda_fwd says how).
    """
    with torch.autocast(q.device.type, enabled=False):
        if _use_triton(q, cu_seqlens, initial_state, output_final_state):
            return _cuda_kernels(backend, static_layout)(
                q, k, v, g_raw, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, doc=_documents(q, cu_seqlens, doc_ids),
                A_log=A_log, dt_bias=dt_bias, g_min=g_min,
            )  # fmt: skip
        g = kda_gate(g_raw, A_log, dt_bias, g_min)
        return chunk_kda_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, doc_ids=doc_ids,
            chunk_size=CHUNK_SIZE,
        )  # fmt: skip
