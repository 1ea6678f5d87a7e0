"""Causal attention within packed documents, and the choice of its kernel.

On CUDA in half precision the documents go to Flash Attention's varlen kernel (no [L, S] mask
exists, so long windows fit); elsewhere SDPA takes the explicit causal/document mask.
"""

import inspect

import torch
import torch.nn.functional as F

from titan_moe.ops.static_documents import cu_seqlens_from_starts, sequence_starts


def document_causal_mask(q_doc: torch.Tensor, kv_doc: torch.Tensor | None = None,
                         query_start: int | None = None) -> torch.Tensor:
    """[B, L] / [B, S] document index per query / key -> [B, 1, L, S] bool, True where allowed.

    query_start: the first query's position counted from the first key. By default S - L: the
    queries are the last L of the S keys (causal alignment at the bottom right), so a
    context-parallel shard attending to its causal prefix uses the same mask as L == S; a key
    segment of a longer prefix passes its own.
    """
    kv_doc = q_doc if kv_doc is None else kv_doc
    length, keys = q_doc.shape[-1], kv_doc.shape[-1]
    query_start = keys - length if query_start is None else query_start
    causal = torch.ones(length, keys, dtype=torch.bool, device=q_doc.device).tril(query_start)
    same_doc = q_doc.unsqueeze(-1) == kv_doc.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


def flash_eligible(q: torch.Tensor) -> bool:
    """Whether Flash Attention's kernels take these queries: CUDA, half precision, head dim
    <= 256."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_doc: torch.Tensor | None,
    kv_doc: torch.Tensor | None,
    scale: float,
    static_layout: bool = False,
) -> torch.Tensor:
    """softmax(q kᵀ scale + causal/document mask) v; q [B,L,H,D], k [B,S,H,D], v [B,S,H,Dv].

    Queries are the last L of the S key positions. On CUDA in half precision the documents go
    to Flash Attention's varlen kernel, so no [L, S] mask exists (long context); elsewhere SDPA
    takes the explicit mask. static_layout (L == S, one doc tensor): the varlen call in fixed
    shapes with no host sync, for CUDA graphs (ops/static_documents.py). Returns [B, L, H, Dv].
    """
    if q_doc is None and q.shape[1] == k.shape[1]:
        o = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)),
                                           is_causal=True, scale=scale)
        return o.transpose(1, 2)
    if q_doc is None:
        q_doc = q.new_zeros(q.shape[:2], dtype=torch.long)
        kv_doc = k.new_zeros(k.shape[:2], dtype=torch.long)
    if flash_eligible(q):
        if static_layout and q.shape[1] == k.shape[1]:
            return static_varlen_document_attention(q, k, v, q_doc, scale)
        return varlen_document_attention(q, k, v, q_doc, kv_doc, scale)
    mask = document_causal_mask(q_doc, kv_doc)
    o = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)),
                                       attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def varlen_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor,
    kv_doc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """document_causal_attention through torch.nn.attention.varlen (Flash Attention, CUDA).

    Every (row, document) is one varlen sequence; keys of documents that end before the first
    query are dropped, so query and key sequences pair up and Flash's bottom-right causal
    alignment is the right one. v is zero-padded to the q/k head dim (Flash needs one head
    dim). Host syncs for the sequence lengths: eager only.
    """
    batch = q.shape[0]
    row = torch.arange(batch, device=q.device)[:, None] * (int(kv_doc.max()) + 1)
    keep = kv_doc >= q_doc[:, :1]
    _, q_counts = torch.unique_consecutive((row + q_doc).flatten(), return_counts=True)
    _, k_counts = torch.unique_consecutive((row + kv_doc)[keep], return_counts=True)
    cu_q = F.pad(q_counts.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = F.pad(k_counts.cumsum(0), (1, 0)).to(torch.int32)
    return _flash_varlen(q, k[keep], v[keep], cu_q, cu_k, int(q_counts.max()),
                         int(k_counts.max()), scale)


def static_varlen_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, scale: float
) -> torch.Tensor:
    """varlen_document_attention for queries and keys of the same positions (training), in
    fixed shapes: cu_seqlens padded with empty sequences to graph_sequence_bound and every
    sequence's length bounded by the row's, so a CUDA graph replays it for any documents."""
    length = q.shape[1]
    cu = cu_seqlens_from_starts(sequence_starts(doc), static=True)
    return _flash_varlen(q, k.flatten(0, 1), v.flatten(0, 1), cu, cu, length, length, scale)


def _flash_varlen(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, cu_q: torch.Tensor,
    cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
) -> torch.Tensor:
    """q [B, L, H, D] against the key rows k_rows [N, H, D], v_rows [N, H, Dv] of the sequences
    cu_q / cu_k, causal within each: [B, L, H, Dv]. v is zero-padded to D for Flash."""
    from torch.nn.attention.varlen import varlen_attn

    batch, length, heads, dim = q.shape
    dv = v_rows.shape[-1]
    causal = _VARLEN_CAUSAL or {"window_size": (-1, 0)}
    o = varlen_attn(q.reshape(batch * length, heads, dim) * (scale * dim**0.5), k_rows,
                    F.pad(v_rows, (0, dim - dv)), cu_q, cu_k, max_q, max_k, **causal)
    return o[..., :dv].reshape(batch, length, heads, dv)


def _varlen_causal_flag() -> dict[str, bool]:
    # torch 2.9 spells causal `is_causal=True`; later versions a (-1, 0) window.
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    return {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {}


_VARLEN_CAUSAL = _varlen_causal_flag()
