"""key_segment_attention (ops/key_segment_attention.py) against whole, unsegmented masked
attention (document_causal_attention: one SDPA over every key under the explicit causal/document
mask), in float64 on CPU: outputs and q, k, v gradients agree to TOL of each tensor's largest
magnitude (at least 1), for several key segments, documents crossing segment boundaries and
query rows that no earlier key segment may serve (lse -inf there, no NaN). The CUDA path's
varlen layout runs too, its Flash kernels replaced by their per-sequence definition."""

import pytest
import torch

from titan_moe.ops import segment_pair_attention as pair_module
from titan_moe.ops.document_attention import document_causal_attention
from titan_moe.ops.key_segment_attention import GivenKeys, key_segment_attention, key_segments

# float64, relative to the largest magnitude: sums reordered by the segments and the merge
# (seen 7.9e-16 over every case here).
TOL = 1e-12
B, S, H, D, DV = 2, 150, 3, 8, 5


def _documents(queries: int) -> torch.Tensor:
    """Row 0: documents start at 30 and at 97 (inside segments of every size tested) and cross
    their boundaries. Row 1: a document starts 5 positions after the queries' first one, so its
    query rows see no key of any earlier key segment (all another document); one more starts
    exactly at S - 20."""
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 30:], doc[0, 97:] = 1, 2
    doc[1, S - queries + 5:], doc[1, S - 20:] = 1, 2
    return doc


def _inputs(queries: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(queries)
    q = torch.randn(B, queries, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, S, H, DV, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _step(attend, q, k, v, grad_out) -> list[torch.Tensor]:
    out = attend(q, k, v)
    return [out, *torch.autograd.grad((out * grad_out).sum(), (q, k, v))]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(g).all(), i
        scale = max(1.0, w.abs().max().item())
        assert (g - w).abs().max().item() <= TOL * scale, i


def test_key_segments_cover_the_prefix_back_from_the_queries():
    assert key_segments(150, 50, 64) == [(0, 36), (36, 100), (100, 150)]
    assert key_segments(150, 50, 100) == [(0, 100), (100, 150)]
    assert key_segments(64, 64, 16) == [(0, 64)]


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "one-document"])
@pytest.mark.parametrize("queries", [S, 50])
@pytest.mark.parametrize("key_segment", [16, 37, 64, 200])
def test_key_segments_match_whole_attention(key_segment, queries, documents):
    _compare(key_segment, queries, _documents(queries) if documents else None)


def test_queries_whose_documents_start_with_them():
    """Every row's queries start a document: no earlier key segment serves any query."""
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[:, S - 50:] = 1
    _compare(16, 50, doc)


def _compare(key_segment: int, queries: int, doc: torch.Tensor | None) -> None:
    q, k, v = _inputs(queries)
    q_doc = None if doc is None else doc[:, S - queries:]
    scale = D**-0.5
    grad_out = torch.randn(B, queries, H, DV, dtype=torch.float64)

    def whole(q, k, v):
        docs = (q_doc, doc) if doc is not None else (torch.zeros(B, queries, dtype=torch.long),
                                                     torch.zeros(B, S, dtype=torch.long))
        return document_causal_attention(q, k, v, *docs, scale)

    def by_segments(q, k, v):
        return key_segment_attention(q, q_doc, doc, (k, v), (), GivenKeys, (), key_segment,
                                     scale)

    _assert_close(_step(by_segments, q, k, v, grad_out), _step(whole, q, k, v, grad_out))


def test_rows_without_earlier_keys_merge_without_nan():
    """Row 1's document from S - 45 on: its queries' lse over every earlier key segment is
    -inf, and their outputs are attention over their own document's keys only."""
    queries = 50
    q, k, v = _inputs(queries)
    doc = _documents(queries)
    out = key_segment_attention(q, doc[:, S - queries:], doc, (k, v), (), GivenKeys, (), 16,
                                D**-0.5)
    rows = slice(5, 30)  # document 1 of row 1: positions S - 45 .. S - 21
    start = S - queries + 5
    alone = document_causal_attention(q[1:, rows], k[1:, start:S - 20], v[1:, start:S - 20],
                                      None, None, D**-0.5)
    _assert_close([out[1:, rows]], [alone])


def _varlen_scores(q, k, cu_q, cu_k, causal, scale):
    """Per varlen sequence: (query rows, key rows, [H, Lq, Lk] scores, causal bottom-right)."""
    for i in range(cu_q.numel() - 1):
        rows_q = slice(int(cu_q[i]), int(cu_q[i + 1]))
        rows_k = slice(int(cu_k[i]), int(cu_k[i + 1]))
        lq, lk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        assert lq > 0 and lk > 0  # the layout sends no empty sequence
        s = torch.einsum("qhd,khd->hqk", q[rows_q], k[rows_k]) * scale
        if causal:
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            s = s.masked_fill(~allowed, float("-inf"))
        yield rows_q, rows_k, s


def fake_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
    """Flash's varlen forward as its docs define it, per sequence: out, lse [H, total_q]."""
    out, lse = torch.zeros_like(q), q.new_zeros(q.shape[1], q.shape[0])
    for rows_q, rows_k, s in _varlen_scores(q, k, cu_q, cu_k, causal, scale):
        lse[:, rows_q] = torch.logsumexp(s, -1)
        out[rows_q] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[rows_k])
    return out, lse, None, None, None


def fake_flash_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                         rng, unused, *, scale):
    """Flash's varlen backward with the given out and lse, per sequence."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows_q, rows_k, s in _varlen_scores(q, k, cu_q, cu_k, causal, scale):
        p = torch.exp(s - lse[:, rows_q, None])
        delta = (do[rows_q] * out[rows_q]).sum(-1).t()[..., None]
        dp = torch.einsum("qhd,khd->hqk", do[rows_q], v[rows_k])
        ds = p * (dp - delta) * scale
        dq[rows_q] = torch.einsum("hqk,khd->qhd", ds, k[rows_k])
        dk[rows_k] = torch.einsum("hqk,qhd->khd", ds, q[rows_q])
        dv[rows_k] = torch.einsum("hqk,qhd->khd", p, do[rows_q])
    return dq, dk, dv


@pytest.mark.parametrize("documents", [True, False, "fresh"],
                         ids=["documents", "one-document", "documents-start-at-the-queries"])
@pytest.mark.parametrize(("queries", "key_segment"), [(S, 37), (50, 16), (50, 64)])
def test_flash_layout_matches_whole_attention(monkeypatch, key_segment, queries, documents):
    """The CUDA path's varlen layout (which rows and keys each segment pair sends, cu_seqlens,
    the scatter back, the merged out and lse into the backward, a pair no row takes part in)
    on CPU, Flash's kernels replaced by their per-sequence definition in float64; v (Dv = 5)
    padded to D = 8."""
    monkeypatch.setattr(pair_module, "flash_eligible", lambda q: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake_flash_backward)
    doc = _documents(queries) if documents is True else None
    if documents == "fresh":
        doc = torch.zeros(B, S, dtype=torch.long)
        doc[:, S - queries:] = 1
    _compare(key_segment, queries, doc)
