"""The KDA backend choice and the fla backend's document bookkeeping, on CPU.

fla's kernels themselves run on CUDA only (tests/gpu/test_kda_triton_cuda.py, against float64);
here: packed documents [B, T] -> fla's varlen sequences, checked against a per-token loop, and
the backend names (one error naming the field for an unknown one, or for 'fla' without fla-core).
"""

import dataclasses

import pytest
import torch

from titan_moe.model.args import ConfigError, apply_overrides, get_flavor
from titan_moe.ops.kda import KDA_BACKENDS, resolve_backend
from titan_moe.ops.kda.chunk_common import CHUNK
from titan_moe.ops.kda.fla_backend import (
    FLA_INSTALLED,
    _chunk_lower,
    _per_sequence,
    _sequences,
    document_sequences,
)
from titan_moe.ops.static_documents import graph_sequence_bound


def random_docs(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=g) < 0.05
    return starts.long().cumsum(1) + 7  # nondecreasing per row; ids need not start at 0


def sequences_by_loop(doc: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    cu, first, last = [], [], []
    batch, seq_len = doc.shape
    for b in range(batch):
        for t in range(seq_len):
            if t == 0 or doc[b, t] != doc[b, t - 1]:
                if t == 0:
                    first.append(len(cu))
                cu.append(b * seq_len + t)
        last.append(len(cu) - 1)
    return cu + [batch * seq_len], first, last


@pytest.mark.parametrize("seed", range(4))
def test_documents_become_fla_sequences(seed):
    doc = random_docs(3, 97, seed)
    doc[1] = 5  # a row that is one document
    cu_seqlens, row_first, row_last, chunk_row = _sequences(doc)
    want_cu, want_first, want_last = sequences_by_loop(doc)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == want_cu
    assert row_first.tolist() == want_first
    assert row_last.tolist() == want_last
    # fla's chunks restart at every sequence start: each token's row in its chunk, by a loop.
    want_row = [[0] * doc.shape[1] for _ in range(doc.shape[0])]
    for b in range(doc.shape[0]):
        for t in range(1, doc.shape[1]):
            same = doc[b, t] == doc[b, t - 1]
            want_row[b][t] = (want_row[b][t - 1] + 1) % CHUNK if same else 0
    assert chunk_row.tolist() == want_row


@pytest.mark.parametrize("seed", range(3))
def test_static_layout_pads_the_exact_sequences_with_empty_ones(seed):
    """CUDA graphs' layout: the loop's sequences, then empty ones (start = end = B*T) up to
    graph_sequence_bound, with the same row picks and chunk rows."""
    g = torch.Generator().manual_seed(seed)
    doc = (torch.rand(2, 640, generator=g) < 1 / 128).long().cumsum(1)  # about 5 starts a row
    want_cu, want_first, want_last = sequences_by_loop(doc)
    cu_seqlens, row_first, row_last, chunk_row = _sequences(doc, static=True)
    bound = graph_sequence_bound(2, 640)
    assert bound == 2 * (640 // CHUNK + 1) and len(want_cu) - 1 < bound
    assert cu_seqlens.tolist() == want_cu + [2 * 640] * (bound + 1 - len(want_cu))
    assert row_first.tolist() == want_first and row_last.tolist() == want_last
    assert torch.equal(chunk_row, _sequences(doc)[3])


def test_chunk_matrices_keep_each_rows_lower_triangle_only():
    """What fla leaves unwritten (right of each chunk row's diagonal) becomes 0; the rest stays."""
    a = torch.randn(2, 150, 3, CHUNK)
    chunk_row = torch.arange(150).remainder(CHUNK).expand(2, -1).clone()
    chunk_row[1, 70:] = torch.arange(80).remainder(CHUNK)  # row 1: a sequence starts at 70
    got = _chunk_lower(a.clone(), chunk_row)
    for b in range(2):
        for t in range(150):
            r = int(chunk_row[b, t])
            assert torch.equal(got[b, t, :, : r + 1], a[b, t, :, : r + 1]), (b, t)
            assert not got[b, t, :, r + 1 :].any(), (b, t)


def test_row_states_seed_each_rows_first_sequence():
    doc = random_docs(3, 64, 0)
    state = torch.randn(3, 2, 4, 4)
    cu_seqlens, row_first, _, _ = _sequences(doc)
    per_seq = _per_sequence(state, row_first, cu_seqlens)
    assert per_seq.shape[0] == cu_seqlens.numel() - 1
    for n in range(per_seq.shape[0]):
        rows = (row_first == n).nonzero().flatten().tolist()
        want = state[rows[0]] if rows else torch.zeros_like(state[0])
        assert torch.equal(per_seq[n], want), n


def test_document_layout_is_reused_for_the_same_unmodified_doc_tensor():
    """One host sync a step: every layer's call with the step's doc tensor reuses the layout;
    an in-place change or another tensor (even with equal values) computes it anew."""
    doc = random_docs(2, 80, 1)
    first = document_sequences(doc)
    assert document_sequences(doc) is first
    doc[1, 40:] += 1  # a new document starts mid-row: the old layout would be stale
    changed = document_sequences(doc)
    assert changed is not first
    for got, want in zip(changed, _sequences(doc), strict=True):
        assert torch.equal(got, want)
    other = doc.clone()
    assert document_sequences(other) is not changed


def test_backend_names():
    assert resolve_backend("triton") == "triton"
    # ours, fla-core installed or not: the faster in the compiled step (bench/RESULTS.md)
    assert resolve_backend("auto") == "triton"
    with pytest.raises(ValueError, match="allowed auto, triton, fla"):
        resolve_backend("cuda")
    with pytest.raises(ConfigError, match=r"titan_moe\.kda_backend = 'cuda'"):
        apply_overrides(get_flavor("debug"), {"kda_backend": "cuda"})
    for name in KDA_BACKENDS[:2]:
        assert apply_overrides(get_flavor("debug"), {"kda_backend": name}).kda_backend == name


@pytest.mark.skipif(FLA_INSTALLED, reason="checks the error raised without fla-core")
def test_fla_backend_without_fla_core_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"titan_moe\.kda_backend = 'fla'.*fla-core"):
        apply_overrides(get_flavor("debug"), {"kda_backend": "fla"})
    with pytest.raises(ConfigError, match="kda_backend"):
        dataclasses.replace(get_flavor("debug"), kda_backend="fla").validate()
