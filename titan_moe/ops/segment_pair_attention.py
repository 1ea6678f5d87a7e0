"""Attention of a query segment over one key segment, returning its log-sum-exp, and the
backward of that piece against the merged output and log-sum-exp: the two steps
key_segment_attention (ops/key_segment_attention.py) runs per key segment.

Queries q [B, T, H, D] are the last T of `keys` positions; the key segment k, v [B, s, H, ·]
covers positions [start, start + s): either the queries' own positions (the diagonal: causal)
or positions wholly before every query. Documents q_doc [B, T], kv_doc [B, s] (None: one).

    forward  -> o_j [B, T, H, Dv] and lse_j [B, T, H], at least float32; lse_j = -inf and
                o_j = 0 on rows that see no key of the segment
    backward (o, lse merged over every segment, dO) -> dq [B, T, H, D] (at least float32),
                dk, dv [B, s, H, ·]

On CUDA in half precision (head dim <= 256) Flash Attention's varlen kernels run it, no [T, s]
scores materialised: the diagonal as one causal sequence per (row, document); an earlier
segment as one full sequence per row, its first query document's rows against that document's
keys. Documents are numbered in increasing order along a row (packing), so a key before the
queries can only be in the row's first query document; rows with no such key are left out
(no empty sequence reaches the kernel), and if no row has one the segment is skipped. The
backward calls Flash's backward with the merged out and lse (ring attention's way: dS = P (dP
- rowsum(dO O)) with P from the global lse). Host syncs for the sequence lengths: eager only.
Elsewhere the plain-PyTorch path materialises the [B, H, T, s] scores under the explicit mask.
"""

import torch
import torch.nn.functional as F

from titan_moe.ops.document_attention import document_causal_mask, flash_eligible
from titan_moe.ops.static_documents import cu_seqlens_from_starts, sequence_starts

NEG_INF = float("-inf")


def pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None,
                 kv_doc: torch.Tensor | None, start: int, keys: int, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_j [B, T, H, Dv], lse_j [B, T, H]) of q over the key segment k, v at `start`."""
    if flash_eligible(q):
        return _flash_forward(q, k, v, q_doc, kv_doc, start, keys, scale)
    wide = torch.promote_types(q.dtype, torch.float32)
    allowed = _allowed(q, k, q_doc, kv_doc, start, keys)
    s = _scores(q.to(wide), k, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, T]
    p = torch.exp(s - finite(lse)[..., None])
    o = torch.einsum("bhts,bshd->bthd", p, v.to(wide))
    return o, lse.transpose(1, 2)


def pair_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, do: torch.Tensor, q_doc: torch.Tensor | None,
                  kv_doc: torch.Tensor | None, start: int, keys: int, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the key segment's share, o [B, T, H, Dv] (q's dtype) and lse [B, T, H]
    the merged ones."""
    if flash_eligible(q):
        return _flash_backward(q, k, v, o, lse, do, q_doc, kv_doc, start, keys, scale)
    wide = torch.promote_types(q.dtype, torch.float32)
    qw, dow = q.to(wide), do.to(wide)
    allowed = _allowed(q, k, q_doc, kv_doc, start, keys)
    p = torch.exp(_scores(qw, k, allowed, scale) - finite(lse).transpose(1, 2)[..., None])
    delta = (dow * o.to(wide)).sum(-1).transpose(1, 2)  # [B, H, T]
    dv = torch.einsum("bhts,bthd->bshd", p, dow)
    dp = torch.einsum("bthd,bshd->bhts", dow, v.to(wide))
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("bhts,bshd->bthd", ds, k.to(wide))
    dk = torch.einsum("bhts,bthd->bshd", ds, qw)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no key seen) replaced by 0: exp(-inf - 0) is the 0 wanted, not NaN."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def _allowed(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor | None,
             kv_doc: torch.Tensor | None, start: int, keys: int) -> torch.Tensor:
    """[B, 1, T, s] bool: query row r (position keys - T + r) may see key position start + c:
    earlier or itself, in its document."""
    if q_doc is None:  # one document a row
        q_doc = q.new_zeros(q.shape[:2], dtype=torch.long)
        kv_doc = k.new_zeros(k.shape[:2], dtype=torch.long)
    return document_causal_mask(q_doc, kv_doc, query_start=keys - q.shape[1] - start)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """[B, H, T, s] scaled scores in q's (widened) dtype, -inf where not allowed."""
    s = torch.einsum("bthd,bshd->bhts", q, k.to(q.dtype)) * scale
    return s.masked_fill(~allowed, NEG_INF)


class _Layout:
    """The varlen layout of one segment pair: which query rows and key rows take part (None:
    all, in order), cu_seqlens, the longest sequences and causality."""

    def __init__(self, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, batch: int,
                 queries: int, length: int, diagonal: bool, device: torch.device) -> None:
        if q_doc is None:
            q_doc = torch.zeros(batch, queries, dtype=torch.long, device=device)
            kv_doc = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.causal = diagonal
        if diagonal:  # one sequence per (row, document), the keys the queries' own positions
            self.q_rows = self.k_rows = None
            self.cu_q = self.cu_k = cu_seqlens_from_starts(sequence_starts(q_doc), static=False)
            self.max_q = self.max_k = int((self.cu_q[1:] - self.cu_q[:-1]).max())
            self.empty = False
            return
        first = q_doc[:, :1]
        self.k_rows = kv_doc == first
        key_counts = self.k_rows.sum(1)
        present = key_counts > 0
        self.q_rows = (q_doc == first) & present[:, None]
        query_counts = self.q_rows.sum(1)
        self.empty = not bool(present.any())
        if self.empty:
            return
        self.cu_q = F.pad(query_counts[present].cumsum(0), (1, 0)).to(torch.int32)
        self.cu_k = F.pad(key_counts[present].cumsum(0), (1, 0)).to(torch.int32)
        self.max_q, self.max_k = int(query_counts.max()), int(key_counts.max())

    def rows(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, n, H, ·] -> the taking-part rows [N, H, ·]."""
        return x.flatten(0, 1) if mask is None else x[mask]

    def scatter(self, rows: torch.Tensor, mask: torch.Tensor | None, shape: tuple[int, ...],
                fill: float, dtype: torch.dtype) -> torch.Tensor:
        """rows [N, ...] back to [B, n, ...], `fill` where no row took part."""
        if mask is None:
            return rows.to(dtype).view(shape)
        out = torch.full(shape, fill, dtype=dtype, device=rows.device)
        out[mask] = rows.to(dtype)
        return out


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Flash takes one head dim for q, k and v: v (and o, dO) zero-padded to q's."""
    return F.pad(x, (0, dim - x.shape[-1]))


def _flash_forward(q, k, v, q_doc, kv_doc, start, keys, scale):
    batch, queries, heads, dim = q.shape
    dv = v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    layout = _Layout(q_doc, kv_doc, batch, queries, k.shape[1], start == keys - queries,
                     q.device)
    if layout.empty:
        return (q.new_zeros(batch, queries, heads, dv, dtype=wide),
                q.new_full((batch, queries, heads), NEG_INF, dtype=wide))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        layout.rows(q, layout.q_rows), layout.rows(k, layout.k_rows),
        _pad_to(layout.rows(v, layout.k_rows), dim), layout.cu_q, layout.cu_k, layout.max_q,
        layout.max_k, 0.0, layout.causal, False, scale=scale)
    o = layout.scatter(out[..., :dv], layout.q_rows, (batch, queries, heads, dv), 0.0, wide)
    lse = layout.scatter(lse.t(), layout.q_rows, (batch, queries, heads), NEG_INF, wide)
    return o, lse


def _flash_backward(q, k, v, o, lse, do, q_doc, kv_doc, start, keys, scale):
    batch, queries, heads, dim = q.shape
    length, dv = k.shape[1], v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    layout = _Layout(q_doc, kv_doc, batch, queries, length, start == keys - queries, q.device)
    if layout.empty:
        return (q.new_zeros(q.shape, dtype=wide), torch.zeros_like(k),
                torch.zeros_like(v))
    # Dropout is off: the rng state is never read (as torch's varlen_attn passes it).
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    rows = layout.q_rows
    dq, dk, dvp = torch.ops.aten._flash_attention_backward(
        _pad_to(layout.rows(do, rows), dim), layout.rows(q, rows),
        layout.rows(k, layout.k_rows), _pad_to(layout.rows(v, layout.k_rows), dim),
        _pad_to(layout.rows(o.to(q.dtype), rows), dim),
        layout.rows(lse.to(wide), rows).t().contiguous(), layout.cu_q, layout.cu_k,
        layout.max_q, layout.max_k, 0.0, layout.causal, rng_state, unused, scale=scale)
    return (layout.scatter(dq, rows, q.shape, 0.0, wide),
            layout.scatter(dk, layout.k_rows, k.shape, 0.0, k.dtype),
            layout.scatter(dvp[..., :dv], layout.k_rows, v.shape, 0.0, v.dtype))
