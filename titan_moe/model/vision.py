"""The native vision tower (spec §7): a ViT over 14×14 patches, a 2×2 patch merge and a projector
into the decoder width, whose outputs replace the `<|image|>` placeholder embeddings.

    z    = PatchEmbed(patches)                      # [B, P, D]: one row per 14×14×3 patch
    z    = ViTBlock_i(z) for i in 1..n_layers       # attention within one image only, 2-D RoPE
    m    = RMSNorm(Projector(merge_2x2(LayerNorm(z))))   # [B, P/4, d]
    e[b, k-th placeholder of row b] = m[b, k]

A packed window carries a fixed number P of patch slots (`window_patches`); its images fill them
in order, each image as whole 2×2 groups in merge order (see data/images.py), and the rest is
padding with `patch_image = -1`. Fixed shapes keep the tower one static graph for the compiler.
2-D RoPE gives any grid size the same positional treatment: half of each head rotates by the
patch's row, the other half by its column, so no learned table has to be interpolated.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_moe.model.args import VisionArgs
from titan_moe.model.norm import RMSNorm


def rope_2d(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, P, head_dim / 2] for patch positions pos [B, P, 2] = (row, column)."""
    quarter = head_dim // 4
    freqs = theta ** (-torch.arange(quarter, device=pos.device, dtype=torch.float32) / quarter)
    pos = pos.float()
    angles = torch.cat([pos[..., :1] * freqs, pos[..., 1:] * freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + h/2}) of x [B, H, P, h] by the angles behind cos, sin."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, p, d = x.shape
        q, k, v = self.qkv(x).view(b, p, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(o.transpose(1, 2).reshape(b, p, d))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = VisionAttention(args.dim, args.n_heads)
        self.mlp_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(args.dim, args.mlp_hidden), nn.GELU(approximate="tanh"),
            nn.Linear(args.mlp_hidden, args.dim),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class VisionTower(nn.Module):
    """patches [B, P, 3·14·14], patch_pos [B, P, 2], patch_image [B, P] -> merged [B, P/4, d]."""

    def __init__(self, args: VisionArgs, out_dim: int) -> None:
        super().__init__()
        self.args = args
        self.group = args.merge * args.merge
        self.patch_embed = nn.Linear(3 * args.patch_size**2, args.dim)
        self.blocks = nn.ModuleDict({str(i): VisionBlock(args) for i in range(args.n_layers)})
        self.merge_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        merged = self.group * args.dim
        # The closing RMSNorm puts image embeddings at the scale of the token embeddings
        # (N(0, 1) at init), so the decoder does not see them as near-zero vectors.
        self.projector = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(approximate="tanh"), nn.Linear(merged, out_dim),
            RMSNorm(out_dim, eps=args.norm_eps),
        )

    def forward(
        self, patches: torch.Tensor, patch_pos: torch.Tensor, patch_image: torch.Tensor
    ) -> torch.Tensor:
        b, p, _ = patches.shape
        x = self.patch_embed(patches)
        cos, sin = rope_2d(patch_pos, self.args.dim // self.args.n_heads, self.args.rope_theta)
        # Patches attend within their own image; padding slots (-1) only to each other.
        mask = (patch_image.unsqueeze(2) == patch_image.unsqueeze(1)).unsqueeze(1)
        for block in self.blocks.values():
            x = block(x, cos, sin, mask)
        # Each image's patches come in merge order, so 4 consecutive slots are one 2×2 group.
        x = self.merge_norm(x).reshape(b, p // self.group, self.group * self.args.dim)
        return self.projector(x)

    def init_weights(self, init_std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=init_std, a=-3 * init_std,
                                      b=3 * init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()


def merged_valid(patch_image: torch.Tensor, group: int) -> torch.Tensor:
    """[B, P / group] bool: which merged slots hold an image (its group's first patch does)."""
    return patch_image[:, ::group] >= 0


def scatter_image_embeddings(
    embeds: torch.Tensor, tokens: torch.Tensor, image_token_id: int,
    merged: torch.Tensor, valid: torch.Tensor,
) -> torch.Tensor:
    """embeds [B, T, d] with its k-th `<|image|>` of row b replaced by merged[b, k].

    Row b must hold exactly as many placeholders as valid merged slots (valid [B, M]); the
    valid slots come first in each row, so the k-th placeholder reads slot k.
    """
    placeholder = tokens == image_token_id
    n_placeholders, n_merged = placeholder.sum(1), valid.sum(1)
    if not torch.equal(n_placeholders, n_merged):
        row = int((n_placeholders != n_merged).nonzero()[0, 0])
        raise ValueError(
            f"row {row} of the batch has {int(n_placeholders[row])} image placeholder tokens "
            f"(id {image_token_id}) but its images give {int(n_merged[row])} merged patches "
            "(one per 2×2 patches); every image needs exactly one placeholder per merged patch"
        )
    slot = (placeholder.cumsum(1) - 1).clamp(0, merged.shape[1] - 1)
    picked = merged.gather(1, slot.unsqueeze(-1).expand(-1, -1, merged.shape[-1]))
    return torch.where(placeholder.unsqueeze(-1), picked.to(embeds.dtype), embeds)
