"""Parameter and FLOP accounting: total and active parameters, training FLOPs per token.

Active parameters are those one token touches: everything but the embedding lookup, with the
routed experts counted at top_k / n_experts of their size (shared experts and routers in full).
Training FLOPs per token = 6 · active matmul parameters + the sequence mixers' token-pair work:
  KDA, per head (Kimi Linear's chunked count, forward): 6d² + 3Cd + C²  (C = chunk, d = head_dim)
  MLA, per head, causal (forward): 2 · (qk + v) · T / 2
both tripled for forward + backward.
The vision tower (spec §7) works per patch, not per token: its parameters are kept out of
`active` and its FLOPs are counted per window of `window_patches` slots (what the tower computes,
empty slots included) and spread over the window's seq_len tokens:
  per patch: 6 · (patch embed + ViT block params) + 3 · n_layers · 4 · window_patches · dim
             (attention over the window's slots) + 6 · projector params / 4 (one per 2×2 group)
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int
    routed_experts: int
    vision: int = 0


def count_params(model: nn.Module, args: TitanMoEArgs) -> ParamCount:
    total = embedding = routed = vision = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.startswith("tok_embeddings."):
            embedding += p.numel()
        elif ".ffn.experts." in name:
            routed += p.numel()
        elif name.startswith("vision."):
            vision += p.numel()
    inactive = routed * (args.n_experts - args.top_k) // args.n_experts
    return ParamCount(total, total - embedding - inactive - vision, embedding, routed, vision)


def vision_flops_per_window(model: nn.Module, args: TitanMoEArgs) -> int:
    """Training FLOPs of the vision tower on one window's patch slots (0 without a tower)."""
    vision = args.vision_config()
    if vision is None:
        return 0
    tower = model.vision
    projector = sum(p.numel() for p in tower.projector.parameters())
    per_patch_params = sum(p.numel() for p in tower.parameters()) - projector
    slots = vision.window_patches
    attention = 3 * vision.n_layers * 4 * slots * vision.dim
    return slots * (6 * per_patch_params + attention) + 6 * projector * slots // 4


def flops_per_token(args: TitanMoEArgs, seq_len: int, active_params: int | None = None) -> int:
    """Training FLOPs per token of a model with `args` at `seq_len` (see the module docstring)."""
    with torch.device("meta"):
        model = TitanMoE(args)
    if active_params is None:
        active_params = count_params(model, args).active
    vision = vision_flops_per_window(model, args) // seq_len
    n_mla = len(args.mla_layers)
    n_kda = args.n_layers - n_mla
    d, c = args.head_dim, KDA_CHUNK_SIZE
    kda = n_kda * args.n_heads * (6 * d * d + 3 * c * d + c * c)
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    mla = n_mla * args.mla_n_heads * (qk + args.v_head_dim) * seq_len
    return 6 * active_params + 3 * (kda + mla) + vision


class CountedTitanMoEArgs(TitanMoEArgs):
    """TitanMoEArgs with torchtitan's parameter and FLOP count (BaseModelArgs protocol).

    The count builds a TitanMoE, which imports args.py; so it lives here, and the TrainSpec's
    flavors are of this class.
    """

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return count_params(model, self).total, flops_per_token(self, seq_len)
