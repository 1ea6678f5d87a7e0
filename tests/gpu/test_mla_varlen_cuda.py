"""MLA's CUDA document attention (Flash varlen) against the explicit-mask SDPA path."""

import pytest
import torch

from tests.metrics import rel_max
from titan_moe.ops.document_attention import (
    document_causal_mask,
    static_varlen_document_attention,
    varlen_document_attention,
)

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 inputs and Flash's bf16 output, relative to the largest magnitude


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix", [0, 192])  # 192: a context-parallel shard's earlier keys
def test_varlen_matches_masked_sdpa(prefix):
    torch.manual_seed(0)
    length, heads, dim, dv = 256, 4, 192, 128
    keys = prefix + length
    q = torch.randn(2, length, heads, dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k = torch.randn(2, keys, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, keys, heads, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    starts = torch.zeros(2, keys, dtype=torch.int32, device="cuda")
    starts[0, [50, keys - 100]] = 1
    starts[1, [keys - length]] = 1
    kv_doc = starts.cumsum(1)
    q_doc = kv_doc[:, prefix:]
    scale = dim**-0.5
    out = varlen_document_attention(q, k, v, q_doc, kv_doc, scale)
    mask = document_causal_mask(q_doc, kv_doc)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(z.float().transpose(1, 2) for z in (q, k, v)), attn_mask=mask, scale=scale
    ).transpose(1, 2)
    assert rel_max(out, ref) < TOL
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_max(g, r) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("starts", [[[50, 51, 180], [1]], [[], []]])
def test_static_varlen_matches_masked_sdpa(starts):
    """The CUDA-graph layout (cu_seqlens padded with empty sequences, max length = the row's):
    documents of 1 token, a row of one document; outputs and gradients against the mask."""
    torch.manual_seed(0)
    length, heads, dim, dv = 256, 4, 192, 128
    q, k = (torch.randn(2, length, heads, dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    v = torch.randn(2, length, heads, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    doc = torch.zeros(2, length, dtype=torch.int32, device="cuda")
    for row, row_starts in enumerate(starts):
        for s in row_starts:
            doc[row, s:] += 1
    scale = dim**-0.5
    out = static_varlen_document_attention(q, k, v, doc, scale)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(z.float().transpose(1, 2) for z in (q, k, v)), attn_mask=document_causal_mask(doc),
        scale=scale).transpose(1, 2)
    assert rel_max(out, ref) < TOL
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_max(g, r) < TOL
