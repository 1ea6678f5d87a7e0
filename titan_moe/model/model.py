"""The K3-class decoder (spec §1): KDA / Gated-MLA mixers, dense or LatentMoE FFNs, and Block
AttnRes in place of every residual connection.

    e = Embed(ids);  blocks, partial = [], e
    for l in layers:
        x = AttnRes_(l,mixer)(blocks + [partial])  if blocks else partial
        if l % block_size == 0:  blocks.append(partial); partial = None
        partial = (partial or 0) + Mixer_l(RMSNorm(x))
        x = AttnRes_(l,ffn)(blocks + [partial])
        partial = partial + FFN_l(RMSNorm(x))
    logits = lm_head(RMSNorm(AttnRes_final(blocks + [partial])))

There is no `x + f(x)`: the residual state is the pair (block stack, partial sum).
Decoding passes `cache` (one KDAState / MLACache per layer, from `new_cache`): the mixers carry
their state across calls, everything else is per token.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.attn_res import AttnResSite, FinalAttnResSite
from titan_moe.model.attn_res_sink import sink_block
from titan_moe.model.kda import KDAState, KimiDeltaAttention, StaticKDAState
from titan_moe.model.mla import GatedMLA, MLACache, StaticMLACache
from titan_moe.model.moe import LatentMoE
from titan_moe.model.norm import RMSNorm
from titan_moe.model.situ_glu import SiTUGLU
from titan_moe.model.vision import VisionTower, merged_valid, scatter_image_embeddings


class DecoderLayer(nn.Module):
    # The residual adds between the sublayers. Compiling with CUDA graphs
    # (parallel/parallelize.py) replaces it per layer with a graphed add: the sum then lives in
    # the graphs' memory, where the next sublayer's graph reads it without copying it in.
    residual_add = staticmethod(torch.add)

    def __init__(self, layer_id: int, args: TitanMoEArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.starts_block = layer_id % args.attn_res_block_size == 0
        # Layer 0 reads the embedding directly: its mixer site would have one source only.
        sink = args.attn_res_grad_sink
        self.grad_sink = sink
        self.mixer_site = AttnResSite(args.dim, args.attn_res_eps, sink) if layer_id > 0 else None
        self.ffn_site = AttnResSite(args.dim, args.attn_res_eps, sink)
        self.mixer_norm = RMSNorm(args.dim, args.norm_eps, args.norm_saves_output)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_saves_output)
        self.mixer = GatedMLA(args) if args.is_mla(layer_id) else KimiDeltaAttention(args)
        if args.is_moe(layer_id):
            self.ffn = LatentMoE(
                dim=args.dim, n_experts=args.n_experts, top_k=args.top_k,
                n_shared=args.n_shared_experts, latent_dim=args.latent_dim,
                expert_hidden=args.expert_hidden, shared_hidden=args.shared_hidden,
                route_scale=args.route_scale, beta1=args.situ_beta1, beta2=args.situ_beta2,
                norm_eps=args.norm_eps, n_bins=args.qb_bins, layer_id=layer_id,
                token_chunk=args.moe_token_chunk, router_gemm=args.router_gemm,
            )
        else:
            self.ffn = SiTUGLU(args.dim, args.dense_hidden, args.situ_beta1, args.situ_beta2,
                               token_chunk=args.seq_segment)
        self.init_std = args.init_std
        self.out_init_std = args.init_std / math.sqrt(2 * (layer_id + 1))

    def forward(
        self,
        blocks: list[torch.Tensor],
        partial: torch.Tensor,
        doc_ids: torch.Tensor | None,
        cache: KDAState | MLACache | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        x = self.mixer_site(blocks + [partial]) if self.mixer_site is not None else partial
        if cache is None:
            a = self.mixer(self.mixer_norm(x), doc_ids)
        else:
            a = self.mixer(self.mixer_norm(x), cache=cache, valid=valid)
        if self.starts_block:
            blocks = blocks + [sink_block(partial) if self.grad_sink else partial]
            partial = a
        else:
            partial = self.residual_add(partial, a)
        x = self.ffn_site(blocks + [partial])
        partial = self.residual_add(partial, self.ffn(self.ffn_norm(x)))
        return blocks, partial

    def init_weights(self) -> None:
        for site in (self.mixer_site, self.ffn_site):
            if site is not None:
                site.init_weights()
        self.mixer_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.mixer.init_weights(self.init_std, self.out_init_std)
        self.ffn.init_weights(self.init_std, self.out_init_std)


class TitanMoE(nn.Module):
    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(i, args) for i in range(args.n_layers)})
        self.final_site = FinalAttnResSite(args.dim, args.attn_res_eps, args.attn_res_grad_sink)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        vision = args.vision_config()
        self.vision = VisionTower(vision, args.dim) if vision is not None else None

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        patches: torch.Tensor | None = None,
        patch_pos: torch.Tensor | None = None,
        patch_image: torch.Tensor | None = None,
        cache: Sequence[KDAState | MLACache] | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: [B, T] int; doc_ids: [B, T] document index per token (packed data) or None;
        patches, patch_pos, patch_image: a window's image patch slots (model/vision.py).

        Decoding: `cache` from `new_cache` is advanced past this call's tokens; `valid` [B, T]
        bool marks real tokens, which come first in each row (right padding).
        """
        if cache is not None and doc_ids is not None:
            raise ValueError("doc_ids and cache exclude each other: a cached row is one document")
        blocks: list[torch.Tensor] = []
        partial = embed_inputs(self.tok_embeddings, self.vision, self.args.image_token_id,
                               tokens, patches, patch_pos, patch_image)
        for i, layer in enumerate(self.layers.values()):
            state = None if cache is None else cache[i]
            blocks, partial = layer(blocks, partial, doc_ids, state, valid)
        h = self.final_site(blocks + [partial])
        return self.output(self.norm(h))

    def new_cache(self, batch: int) -> list[KDAState | MLACache]:
        """Empty per-layer decode states for `batch` rows (KDA: constant size; MLA: grows)."""
        return [layer.mixer.new_cache(batch) for layer in self.layers.values()]

    def new_static_cache(self, batch: int, max_len: int) -> list[StaticKDAState | StaticMLACache]:
        """Preallocated per-layer decode states for `batch` rows and up to `max_len` tokens a
        row, written in place (the compiled decode step of titan_moe/serve/static_decode.py)."""
        return [layer.mixer.new_static_cache(batch, max_len) for layer in self.layers.values()]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        init_embedding_weights(self.tok_embeddings)
        for layer in self.layers.values():
            layer.init_weights()
        self.final_site.init_weights()
        self.norm.reset_parameters()
        if self.vision is not None:
            self.vision.init_weights(self.args.init_std)
        init_head_weights(self.output)


def embed_inputs(
    tok_embeddings: nn.Embedding,
    vision: VisionTower | None,
    image_token_id: int,
    tokens: torch.Tensor,
    patches: torch.Tensor | None = None,
    patch_pos: torch.Tensor | None = None,
    patch_image: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first residual source: the token embeddings, with the tower's merged patch embeddings
    at the image tokens when the batch has patches. Shared by the model and its first pipeline
    stage."""
    embedded = tok_embeddings(tokens)
    if patches is None:
        return embedded
    if vision is None:
        raise ValueError("the batch has image patches but titan_moe.vision = 'none'")
    merged = vision(patches, patch_pos, patch_image)
    return scatter_image_embeddings(embedded, tokens, image_token_id, merged,
                                    merged_valid(patch_image, vision.group))


def init_embedding_weights(embedding: nn.Embedding) -> None:
    """The token embedding's init, shared by the model and its first pipeline stage."""
    nn.init.normal_(embedding.weight)


def init_head_weights(output: nn.Linear) -> None:
    """The LM head's init (truncated normal, std dim^-1/2), shared by the model and its last
    pipeline stage."""
    std = output.in_features**-0.5
    nn.init.trunc_normal_(output.weight, std=std, a=-3 * std, b=3 * std)
