"""Packed-document bookkeeping for KDA with static shapes.

Documents are given either as fla-style `cu_seqlens` (offsets [N+1] into one packed row) or as
`doc_ids` [B, T] (nondecreasing per row). Both become a per-token document index
`doc[b, t]`; for cu_seqlens, `doc[0, t] = n` such that `cu_seqlens[n] <= t < cu_seqlens[n+1]`
(empty documents own no token). No host sync: everything stays a tensor of static shape.
"""

import torch
from torch import Tensor


def doc_index_from_cu_seqlens(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """Per-token document index [seq_len] (int64) for offsets `cu_seqlens` [N+1]."""
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # right=True: a token at an offset belongs to the document that starts there, and
    # empty documents (equal offsets) are skipped over.
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).long()


def validate_documents(
    batch: int, seq_len: int, cu_seqlens: Tensor | None, doc_ids: Tensor | None
) -> None:
    """Raise ValueError, naming the argument, for a malformed document specification."""
    if cu_seqlens is not None and doc_ids is not None:
        raise ValueError("give at most one of cu_seqlens and doc_ids, not both")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D with N+1 >= 2 entries, got {list(cu_seqlens.shape)}"
            )
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if batch != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of 1, got batch {batch}")
    if doc_ids is not None:
        if tuple(doc_ids.shape) != (batch, seq_len):
            raise ValueError(f"doc_ids must be [B, T] = {[batch, seq_len]}, got {doc_ids.shape}")
        if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise ValueError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
