"""Packed documents as varlen sequences in fixed shapes, for CUDA graphs.

A graph replays the shapes it recorded and cannot read the host, so the document layout of a
[B, T] batch (which varlen kernels take as cu_seqlens, one entry per sequence start) is built
on the device with a fixed length: graph_sequence_bound sequences, those past the real count
empty (start = end = B*T). fla's KDA kernels (use_graph mode) and Flash's varlen attention both
return at once for an empty sequence. The bound: one sequence per row plus one per
TOKENS_PER_SEQUENCE tokens, documents that long on average; kernels' grids grow with it, so it
stays near a real count rather than one per token. A batch past it stops at a device-side
assert; the trainer refuses it on the host first, with its count.
"""

import torch
import torch.nn.functional as F

TOKENS_PER_SEQUENCE = 64


def graph_sequence_bound(batch: int, seq_len: int) -> int:
    """How many sequences (row starts and document starts) a [batch, seq_len] layout holds."""
    return batch * (seq_len // TOKENS_PER_SEQUENCE + 1)


def sequence_starts(doc: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True where a sequence starts (every row's first token, every document
    change)."""
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return starts


def cu_seqlens_from_starts(starts: torch.Tensor, static: bool) -> torch.Tensor:
    """cu_seqlens int32 over the flattened rows: [N + 1] with N the real count (read on the
    host), or static: [graph_sequence_bound + 1], padded with empty sequences, no host sync."""
    flat = starts.flatten()
    total = flat.numel()
    if static:
        bound = graph_sequence_bound(*starts.shape)
        torch._assert_async(flat.sum() <= bound, "more sequences than graph_sequence_bound")
        first = torch.nonzero_static(flat, size=bound, fill_value=total).flatten()
    else:
        first = flat.nonzero().flatten()
    # Padded on the device: a host tensor's copy is not allowed while a graph records.
    return F.pad(first, (0, 1), value=total).to(torch.int32)
