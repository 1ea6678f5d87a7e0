"""Gated Multi-head Latent Attention with NoPE (spec §4).

    c_q = RMSNorm(W_qa x);  q = W_qb c_q                 -> per head [q_nope | q_rope]
    [c_kv | k_rope] = W_kva x                            (k_rope shared by all heads)
    [k_nope | v] = W_kvb RMSNorm(c_kv)
    o_h = softmax(q_h k_hᵀ / sqrt(nope + rope) + causal/document mask) v_h
    y = W_o(σ(W_g x) ⊙ concat_h o_h)

NoPE: the rope part is kept and scored but never rotated, so no position enters attention.
Packed documents are masked from each other through `doc_ids`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_moe.model.args import TitanMoEArgs


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document index per token -> [B, 1, T, T] bool, True where attention is allowed."""
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


class GatedMLA(nn.Module):
    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.n_heads = args.mla_n_heads
        self.nope = args.qk_nope_head_dim
        self.rope = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_lora = args.kv_lora_rank
        qk = self.nope + self.rope
        self.scale = qk**-0.5
        self.w_qa = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
        self.w_qb = nn.Linear(args.q_lora_rank, self.n_heads * qk, bias=False)
        self.w_kva = nn.Linear(args.dim, self.kv_lora + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora, eps=args.norm_eps)
        self.w_kvb = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.w_g = nn.Linear(args.dim, self.n_heads * self.v_dim, bias=False)
        self.w_o = nn.Linear(self.n_heads * self.v_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.n_heads
        q = self.w_qb(self.q_norm(self.w_qa(x))).view(b, t, h, self.nope + self.rope)
        c_kv, k_rope = self.w_kva(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.w_kvb(self.kv_norm(c_kv)).view(b, t, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(b, t, h, self.rope)], dim=-1)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if doc_ids is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = document_causal_mask(doc_ids)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        o = o.transpose(1, 2).reshape(b, t, h * self.v_dim)
        return self.w_o(torch.sigmoid(self.w_g(x)) * o)

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        for lin in (self.w_qa, self.w_qb, self.w_kva, self.w_kvb, self.w_g):
            nn.init.trunc_normal_(lin.weight, std=init_std)
        nn.init.trunc_normal_(self.w_o.weight, std=out_init_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
