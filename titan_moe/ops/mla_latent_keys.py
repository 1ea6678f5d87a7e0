"""MLA's keys and values from its latents, with a hand-written backward: the projection that
key_segment_attention (ops/key_segment_attention.py) runs per key segment and recomputes in
its backward, where there is no autograd graph to differentiate through.

    c = RMSNorm(c_kv) (in at least float32, back to c_kv's dtype);  [k_nope | v] = c W_kvbᵀ
    k = [k_nope | k_rope]  (k_rope [B, s, R] shared by every head)

Backward, with x = c_kv widened, r = (mean(x²) + eps)^-1/2, x̂ = x r and g = dc ∘ w:
    dW_kvb = dkvᵀ c,  dc = dkv W_kvb,  dw = Σ dc ∘ x̂,  dx = r (g - x̂ mean(g ∘ x̂)),
    dk_rope = Σ_heads dk[..., nope:].
inputs (c_kv [B, s, C], k_rope [B, s, R]); weights (RMSNorm weight [C], W_kvb [H (N + V), C]);
options (heads, nope, eps).
"""

import torch
import torch.nn.functional as F


class LatentKeys:
    @staticmethod
    def project(inputs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...],
                options: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        c_kv, k_rope = inputs
        heads, nope, eps = options
        return _keys_values(_normed(c_kv, weights[0], eps), k_rope, weights[1], heads, nope)

    @staticmethod
    def backward(dk: torch.Tensor, dv: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], options: tuple
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        c_kv, k_rope = inputs
        norm_weight, w_kvb = weights
        _, nope, eps = options
        dc, d_w_kvb, d_rope = _keys_values_backward(
            dk, dv, _normed(c_kv, norm_weight, eps), w_kvb, nope)
        wide = torch.promote_types(c_kv.dtype, torch.float32)
        x = c_kv.to(wide)
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        x_hat = x * r
        g = dc.to(wide) * norm_weight.to(wide)
        dx = r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        d_norm = (dc.to(wide) * x_hat).flatten(0, 1).sum(0)
        return (dx.to(c_kv.dtype), d_rope.to(k_rope.dtype)), (d_norm, d_w_kvb)


def _keys_values(c: torch.Tensor, k_rope: torch.Tensor, w_kvb: torch.Tensor, heads: int,
                 nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[k_nope | v] = c W_kvbᵀ per head; k = [k_nope | k_rope] (k_rope shared by the heads)."""
    kv = F.linear(c, w_kvb).unflatten(-1, (heads, -1))
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    rope = k_rope.unsqueeze(2).expand(*k_rope.shape[:2], heads, k_rope.shape[-1])
    return torch.cat([k_nope, rope], dim=-1), v


def _keys_values_backward(dk: torch.Tensor, dv: torch.Tensor, c: torch.Tensor,
                          w_kvb: torch.Tensor, nope: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_keys_values' gradients: (dc, dW_kvb, dk_rope)."""
    dkv = torch.cat([dk[..., :nope], dv], dim=-1).flatten(-2)  # [B, s, H (N + V)]
    return dkv @ w_kvb, dkv.flatten(0, 1).t() @ c.flatten(0, 1), dk[..., nope:].sum(2)


def _normed(c_kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as model/norm.py computes it: in at least float32, returned in c_kv's dtype."""
    wide = torch.promote_types(c_kv.dtype, torch.float32)
    return F.rms_norm(c_kv.to(wide), (c_kv.shape[-1],), weight.to(wide), eps).to(c_kv.dtype)


class CachedLatentKeys:
    """MLA's keys and values from its decode cache's entries [RMSNorm(c_kv) | k_rope] (already
    normed): the projection of the static cache's prefill (model/mla.py), which attends in the
    up-projected form by key segments. inputs (kv [B, s, C + R]); weights (W_kvb [H (N + V), C]);
    options (heads, nope, C). Backward: dW_kvb = dkvᵀ c, dc = dkv W_kvb, dk_rope as above."""

    @staticmethod
    def project(inputs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...],
                options: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        heads, nope, latent = options
        c, k_rope = inputs[0].split([latent, inputs[0].shape[-1] - latent], dim=-1)
        return _keys_values(c, k_rope, weights[0], heads, nope)

    @staticmethod
    def backward(dk: torch.Tensor, dv: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], options: tuple
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        _, nope, latent = options
        kv = inputs[0]
        dc, d_w_kvb, d_rope = _keys_values_backward(dk, dv, kv[..., :latent], weights[0], nope)
        return (torch.cat([dc, d_rope], dim=-1).to(kv.dtype),), (d_w_kvb,)
