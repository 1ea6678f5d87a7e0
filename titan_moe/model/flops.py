"""Parameter and FLOP accounting: total and active parameters, training FLOPs per token.

Active parameters are those one token touches: everything but the embedding lookup, with the
routed experts counted at top_k / n_experts of their size (shared experts and routers in full).
Training FLOPs per token = 6 · active matmul parameters + the sequence mixers' token-pair work:
  KDA, per head (Kimi Linear's chunked count, forward): 6d² + 3Cd + C²  (C = chunk, d = head_dim)
  MLA, per head, causal (forward): 2 · (qk + v) · T / 2
both tripled for forward + backward.
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


def count_params(model: nn.Module, args: TitanMoEArgs) -> ParamCount:
    total = embedding = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.startswith("tok_embeddings."):
            embedding += p.numel()
        elif ".ffn.experts." in name:
            routed += p.numel()
    inactive = routed * (args.n_experts - args.top_k) // args.n_experts
    return ParamCount(total, total - embedding - inactive, embedding, routed)


def flops_per_token(args: TitanMoEArgs, seq_len: int, active_params: int | None = None) -> int:
    if active_params is None:
        with torch.device("meta"):
            active_params = count_params(TitanMoE(args), args).active
    n_mla = len(args.mla_layers)
    n_kda = args.n_layers - n_mla
    d, c = args.head_dim, KDA_CHUNK_SIZE
    kda = n_kda * args.n_heads * (6 * d * d + 3 * c * d + c * c)
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    mla = n_mla * args.mla_n_heads * (qk + args.v_head_dim) * seq_len
    return 6 * active_params + 3 * (kda + mla)
