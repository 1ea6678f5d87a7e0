"""key_segment_attention on CUDA in bf16 (Flash's varlen kernels per segment pair, merged by
log-sum-exp) against the explicit-mask SDPA over every key in float32: outputs and q, k, v
gradients within TOL of the largest magnitude."""

import pytest
import torch

from tests.metrics import rel_max
from titan_moe.ops.document_attention import document_causal_mask
from titan_moe.ops.key_segment_attention import GivenKeys, key_segment_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TOL = 2e-2  # bf16 inputs, Flash's bf16 outputs per pair, as test_mla_varlen_cuda.py


@pytest.mark.parametrize("key_segment", [128, 200])
@pytest.mark.parametrize("queries", [256, 640])  # 640: every key
def test_key_segments_match_masked_sdpa(key_segment, queries):
    torch.manual_seed(0)
    keys, heads, dim, dv = 640, 4, 192, 128
    q = torch.randn(2, queries, heads, dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k = torch.randn(2, keys, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, keys, heads, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # Row 0: documents crossing segment boundaries; row 1: a document starting just after the
    # queries' first position (its rows see no earlier key segment).
    starts = torch.zeros(2, keys, dtype=torch.int32, device="cuda")
    starts[0, [50, 300, keys - 100]] = 1
    starts[1, [keys - queries + 5]] = 1
    kv_doc = starts.cumsum(1)
    q_doc = kv_doc[:, keys - queries:]
    scale = dim**-0.5
    out = key_segment_attention(q, q_doc, kv_doc, (k, v), (), GivenKeys, (), key_segment, scale)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(z.float().transpose(1, 2) for z in (q, k, v)),
        attn_mask=document_causal_mask(q_doc, kv_doc), scale=scale).transpose(1, 2)
    assert torch.isfinite(out).all() and rel_max(out, ref) < TOL
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all() and rel_max(g, r) < TOL
