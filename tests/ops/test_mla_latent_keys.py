"""CachedLatentKeys (ops/mla_latent_keys.py), the static-cache prefill's projection, run by
key_segment_attention against autograd through the whole layer's form: keys [c W_ukᵀ | k_rope]
and values c W_uvᵀ of the cache entries [c | k_rope], one masked SDPA over every key
(document_causal_attention). float64 on CPU; outputs and the gradients of q, the entries and
W_kvb agree to TOL of each tensor's largest magnitude (at least 1)."""

import pytest
import torch
import torch.nn.functional as F

from titan_moe.ops.document_attention import document_causal_attention
from titan_moe.ops.key_segment_attention import key_segment_attention
from titan_moe.ops.mla_latent_keys import CachedLatentKeys

TOL = 1e-12  # float64, sums reordered by the segments and the merge
B, S, H, N, R, V, C = 2, 90, 3, 6, 4, 5, 7


def _whole(q, kv, w_kvb):
    c, k_rope = kv.split([C, R], dim=-1)
    k_nope, v = F.linear(c, w_kvb).unflatten(-1, (H, N + V)).split([N, V], dim=-1)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, R)], dim=-1)
    return document_causal_attention(q, k, v, None, None, (N + R) ** -0.5)


@pytest.mark.parametrize(("queries", "key_segment"), [(30, 16), (30, 200), (S, 32)])
def test_cached_latent_keys_by_segments_match_the_whole_layer(queries, key_segment):
    torch.manual_seed(queries + key_segment)
    q = torch.randn(B, queries, H, N + R, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, S, C + R, dtype=torch.float64, requires_grad=True)
    w_kvb = torch.randn(H * (N + V), C, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, queries, H, V, dtype=torch.float64)
    results = []
    for attend in (
        lambda: key_segment_attention(q, None, None, (kv,), (w_kvb,), CachedLatentKeys,
                                      (H, N, C), key_segment, (N + R) ** -0.5),
        lambda: _whole(q, kv, w_kvb),
    ):
        out = attend()
        results.append([out, *torch.autograd.grad((out * grad_out).sum(), (q, kv, w_kvb))])
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        assert (got - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item()), i
