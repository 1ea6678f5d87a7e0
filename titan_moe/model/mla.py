"""Gated Multi-head Latent Attention with NoPE (spec §4).

    c_q = RMSNorm(W_qa x);  q = W_qb c_q                 -> per head [q_nope | q_rope]
    [c_kv | k_rope] = W_kva x                            (k_rope shared by all heads)
    [k_nope | v] = W_kvb RMSNorm(c_kv)
    o_h = softmax(q_h k_hᵀ / sqrt(nope + rope) + causal/document mask) v_h
    y = W_o(σ(W_g x) ⊙ concat_h o_h)

NoPE: the rope part is kept and scored but never rotated, so no position enters attention.
Packed documents are masked from each other through `doc_ids`.

Long context (`seq_segment` > 0, training): the latents [c_kv | k_rope] are computed once for
the whole sequence; then each query segment of seq_segment positions runs under its own
non-reentrant checkpoint: its q, attention over its causal prefix by key segments of
seq_segment positions (ops/key_segment_attention.py: each key segment's keys and values
up-projected from its latents inside the loop, ops/mla_latent_keys.py, the partial attentions
merged by log-sum-exp, and the backward recomputing them one key segment at a time), the gate
and W_o. A backward (and a full-AC recompute around the layer) then holds one segment's q,
gate and attention output and one key segment's k and v, not a prefix's. The cost: each pair
of segments re-up-projects its key segment, about T / (2N) times the kv up-projection's FLOPs
in the forward, and again in the backward. Outputs and gradients equal the whole layer's up to
the order of sums.

Decoding (`cache`, an MLACache) keeps only [RMSNorm(c_kv) | k_rope] per token and attends in the
absorbed form: with W_kvb = [W_uk; W_uv] per head, q_nope·(W_uk c) = (W_ukᵀ q_nope)·c and
Σ p W_uv c = W_uv Σ p c, so one latent "head" serves as key and value for every query head.

A `StaticMLACache` (`GatedMLA.new_static_cache`) is the same cache preallocated to a maximum
length, for the compiled, CUDA-graphed decode step (titan_moe/serve/static_decode.py): a
one-token call writes its slot at the device counter `pos` and attends over every slot of the
buffer, masked to the valid ones, so each step has the same shapes and reads no host value.
Its prefill chunks (eager) attend in the up-projected form, the keys and values projected from
the cache by key segments as in training's long context, unless a row holds padding.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.norm import RMSNorm
from titan_moe.ops.document_attention import document_causal_attention
from titan_moe.ops.key_segment_attention import key_segment_attention
from titan_moe.ops.mla_decode import mla_decode_attention
from titan_moe.ops.mla_latent_keys import CachedLatentKeys, LatentKeys


@dataclass
class MLACache:
    """One MLA layer's decode cache: per slot the key [RMSNorm(c_kv) | k_rope] (its first kv_lora
    channels are also the value) and valid (False for padding slots, which no query attends).

    kv [B, capacity, kv_lora + rope] and valid [B, capacity] hold `length` filled slots. Without
    autograd, slots are written in place and the capacity doubles when full, so a decode step
    copies O(1) slots, not the whole cache; with autograd (RL trains through chunked rollouts)
    the cache grows by concatenation and stays exactly `length` long, keeping the graph intact.
    """

    kv: torch.Tensor
    valid: torch.Tensor
    length: int

    def append(self, kv: torch.Tensor, valid: torch.Tensor) -> None:
        end = self.length + kv.shape[1]
        if torch.is_grad_enabled():
            self.kv = torch.cat([self.kv[:, : self.length], kv], 1)
            self.valid = torch.cat([self.valid[:, : self.length], valid], 1)
        else:
            if end > self.kv.shape[1]:
                self.kv = _grown(self.kv, max(end, 2 * self.kv.shape[1]))
                self.valid = _grown(self.valid, self.kv.shape[1])
            self.kv[:, self.length : end] = kv
            self.valid[:, self.length : end] = valid
        self.length = end

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, valid) of the filled slots (views)."""
        return self.kv[:, : self.length], self.valid[:, : self.length]


@dataclass
class StaticMLACache:
    """One MLA layer's preallocated decode cache: kv [B, max_len, kv_lora + rope] and valid
    [B, max_len] (False until written, and for padding slots), `pos` a 0-d int64 device tensor
    (slots written so far, shared by the rows), `filled` its host copy.

    A one-token call (the decode step) writes slot `pos` and reads no host value, so it traces
    to one static graph; a longer call (a prefill chunk, eager) writes slots filled..filled+t.
    The caller advances `filled` after every call (`advance_static_cache`); the model never
    does, so that the compiled step has no Python counter in it.
    """

    kv: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    filled: int = 0

    @property
    def max_len(self) -> int:
        return self.kv.shape[1]


def _grown(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    out = buffer.new_zeros(buffer.shape[0], capacity, *buffer.shape[2:])
    out[:, : buffer.shape[1]] = buffer
    return out


class GatedMLA(nn.Module):
    # Attention within documents, attention(q, k, v, q_doc, kv_doc, scale). Compiling with CUDA
    # graphs (parallel/parallelize.py) replaces it per instance with its fixed-shape layout.
    attention = staticmethod(document_causal_attention)
    # Keys a static-cache prefill chunk up-projects at a time: bounds its transient keys and
    # values (about 1 GiB a row at the proxy's widths, Flash's padded v included).
    prefill_key_segment = 32768

    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.n_heads = args.mla_n_heads
        self.nope = args.qk_nope_head_dim
        self.rope = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_lora = args.kv_lora_rank
        self.seq_segment = args.seq_segment
        qk = self.nope + self.rope
        self.scale = qk**-0.5
        self.w_qa = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
        self.w_qb = nn.Linear(args.q_lora_rank, self.n_heads * qk, bias=False)
        self.w_kva = nn.Linear(args.dim, self.kv_lora + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora, eps=args.norm_eps)
        self.w_kvb = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.w_g = nn.Linear(args.dim, self.n_heads * self.v_dim, bias=False)
        self.w_o = nn.Linear(self.n_heads * self.v_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        cache: MLACache | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B,T,d]. With `cache` (decoding) each row is one document continued from the cache,
        `valid` [B,T] bool marks its real tokens, and the call's tokens are appended to it."""
        if isinstance(cache, StaticMLACache):
            return self._forward_static(x, cache, valid)
        if cache is not None:
            return self._forward_absorbed(x, cache, valid)
        c_kv, k_rope, kv_doc_ids = self.latent_prefix(self.w_kva(x), doc_ids)
        if 0 < self.seq_segment < x.shape[1]:
            return self._forward_by_segments(x, doc_ids, c_kv, k_rope, kv_doc_ids)
        return self._segment(x, doc_ids, c_kv, k_rope, kv_doc_ids)

    def _forward_by_segments(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None, c_kv: torch.Tensor,
        k_rope: torch.Tensor, kv_doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """forward over query segments of seq_segment positions, each under its own checkpoint
        against the keys of its causal prefix, by key segments."""
        # The keys may begin before x's first position (latent_prefix's causal prefix).
        offset = c_kv.shape[1] - x.shape[1]
        outputs, start = [], 0
        for xs in x.split(self.seq_segment, 1):  # split: its backward is one cat
            end = start + xs.shape[1]
            keys = offset + end
            docs = None if doc_ids is None else doc_ids[:, start:end]
            kv_docs = None if kv_doc_ids is None else kv_doc_ids[:, :keys]
            # The layer draws no random numbers: no RNG state to save and restore.
            outputs.append(checkpoint(self._query_segment, xs, docs, c_kv[:, :keys],
                                      k_rope[:, :keys], kv_docs, use_reentrant=False,
                                      preserve_rng_state=False))
            start = end
        return torch.cat(outputs, 1)

    def _query_segment(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None, c_kv: torch.Tensor,
        k_rope: torch.Tensor, kv_doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """_segment's result by key segments of seq_segment positions, each up-projected from
        its latents inside the attention's loop (and again in its backward)."""
        # A segment of rows > 1 is a strided view: one copy the projections share.
        x = x.contiguous()
        # The norm's eps, or F.rms_norm's default for None (its widened dtype's).
        eps = self.kv_norm.eps or torch.finfo(torch.promote_types(c_kv.dtype, torch.float32)).eps
        o = key_segment_attention(
            self._queries(x), doc_ids, kv_doc_ids, (c_kv, k_rope),
            (self.kv_norm.weight, self.w_kvb.weight), LatentKeys, (self.n_heads, self.nope, eps),
            self.seq_segment, self.scale)
        return self._output(x, o)

    def _segment(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None, c_kv: torch.Tensor,
        k_rope: torch.Tensor, kv_doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layer's queries x [B,T,d] (documents doc_ids) against the keys' latents c_kv,
        k_rope [B,S,·] (documents kv_doc_ids), S >= T: the queries are the last T keys."""
        # A segment of rows > 1 is a strided view: one copy the projections share, where each
        # would copy it for its GEMM (and save its copy).
        x = x.contiguous()
        b = x.shape[0]
        h = self.n_heads
        q = self._queries(x)
        s = c_kv.shape[1]
        kv = self.w_kvb(self.kv_norm(c_kv)).view(b, s, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(b, s, h, self.rope)], dim=-1)
        o = self.attention(q, k, v, doc_ids, kv_doc_ids, self.scale)
        return self._output(x, o)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,d] (contiguous) -> q [B,T,h, nope + rope]."""
        b, t, _ = x.shape
        return self.w_qb(self.q_norm(self.w_qa(x))).view(b, t, self.n_heads, self.nope + self.rope)

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The gate and W_o: x [B,T,d] and the attention's o [B,T,h,v] -> [B,T,d]."""
        b, t, _ = x.shape
        return self.w_o(torch.sigmoid(self.w_g(x)) * o.reshape(b, t, self.n_heads * self.v_dim))

    def latent_prefix(
        self, latent: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[c_kv | k_rope] of the keys -> (c_kv, k_rope, their doc ids): the local tokens.

        Context parallelism (titan_moe/parallel/context_parallel.py) replaces it per instance
        with the all-gathered causal prefix of the sequence.
        """
        c_kv, k_rope = latent.split([self.kv_lora, self.rope], dim=-1)
        return c_kv, k_rope, doc_ids

    def _forward_absorbed(
        self, x: torch.Tensor, cache: MLACache, valid: torch.Tensor | None
    ) -> torch.Tensor:
        q_nope, q_rope, new_kv, valid = self._decode_inputs(x, valid)
        cache.append(new_kv, valid)
        kv_slots, valid_slots = cache.filled()
        w_uk, w_uv = self._absorbed_weights()
        query = self._absorbed_query(q_nope, q_rope, w_uk)
        o = self._attend_masked(query, kv_slots, valid_slots, x.shape[1])
        return self._absorbed_out(x, o, w_uv)

    def _decode_inputs(
        self, x: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope, q_rope, the call's cache entries [kv_norm(c_kv) | k_rope] zeroed at padding,
        valid [B, T], all True when None) of a decoding call."""
        b, t, _ = x.shape
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        q = self.w_qb(self.q_norm(self.w_qa(x))).view(b, t, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.w_kva(x).split([self.kv_lora, self.rope], dim=-1)
        new_kv = torch.where(valid.unsqueeze(-1), torch.cat([self.kv_norm(c_kv), k_rope], -1), 0.0)
        return q_nope, q_rope, new_kv, valid

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.n_heads
        return self.w_kvb.weight.view(h, self.nope + self.v_dim, self.kv_lora).split(
            [self.nope, self.v_dim], dim=1)

    def _absorbed_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor
    ) -> torch.Tensor:
        """[B,h,t, kv_lora + rope]: W_ukᵀ q_nope next to q_rope."""
        return torch.cat([torch.einsum("bthn,hnc->bhtc", q_nope, w_uk), q_rope.transpose(1, 2)],
                         dim=-1)

    def _absorbed_out(self, x: torch.Tensor, o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        o = torch.einsum("bhtc,hvc->bthv", o, w_uv).reshape(b, t, self.n_heads * self.v_dim)
        return self.w_o(torch.sigmoid(self.w_g(x)) * o)

    def _attend_masked(
        self, query: torch.Tensor, kv_slots: torch.Tensor, valid_slots: torch.Tensor, t: int
    ) -> torch.Tensor:
        """query [B,h,t,C] (the last t of the s slots) over kv_slots [B,s,C] -> [B,h,t,kv_lora]."""
        b, h = query.shape[:2]
        s = kv_slots.shape[1]
        key = kv_slots.unsqueeze(1).expand(b, h, s, -1)
        value = kv_slots[..., : self.kv_lora].unsqueeze(1).expand(b, h, s, self.kv_lora)
        slot = torch.arange(s, device=query.device)
        query_slot = slot[s - t :, None]
        # A padding query also sees its own slot, so no row of the mask is empty (no NaN).
        mask = (valid_slots[:, None, :] & (slot <= query_slot)) | (slot == query_slot)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask.unsqueeze(1),
                                              scale=self.scale)

    def _forward_static(
        self, x: torch.Tensor, cache: StaticMLACache, valid: torch.Tensor | None
    ) -> torch.Tensor:
        q_nope, q_rope, new_kv, valid = self._decode_inputs(x, valid)
        if x.shape[1] > 1:
            return self._prefill(x, q_nope, q_rope, new_kv, valid, cache)
        w_uk, w_uv = self._absorbed_weights()
        query = self._absorbed_query(q_nope, q_rope, w_uk)
        o = self._decode_step_attention(query, new_kv, valid, cache)
        return self._absorbed_out(x, o, w_uv)

    def _decode_step_attention(
        self, query: torch.Tensor, new_kv: torch.Tensor, valid: torch.Tensor,
        cache: StaticMLACache,
    ) -> torch.Tensor:
        """One token per row, static shapes, no host value: write slot `pos`, attend over the
        whole buffer with the unwritten and padding slots masked, pos += 1."""
        pos = cache.pos.view(1)
        cache.kv.index_copy_(1, pos, new_kv.to(cache.kv.dtype))
        cache.valid.index_copy_(1, pos, valid)
        b, h, _, width = query.shape
        # MQA form: the h query heads are h rows against the one latent head. Slots past pos
        # were never written (valid False); a padding query sees its own slot.
        q = query.reshape(b, h, width).to(cache.kv.dtype)
        o = mla_decode_attention(q, cache.kv, cache.valid, cache.pos, self.scale, self.kv_lora)
        cache.pos.add_(1)
        return o.unsqueeze(2).to(query.dtype)

    def _prefill(
        self, x: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor, new_kv: torch.Tensor,
        valid: torch.Tensor, cache: StaticMLACache,
    ) -> torch.Tensor:
        """t > 1 tokens (eager): write slots filled..filled+t, attend over the filled prefix.

        When no slot so far is padding (one document a row), the up-projected form: the prefix's
        keys and values projected from the cache by key segments (ops/key_segment_attention.py,
        Flash Attention on CUDA): two thirds of the absorbed form's FLOPs a score at the proxy's
        widths (head dims 192 and v padded to 192 against 320 / 256), in a kernel that skips the
        masked half; 2.4x faster at 512K (H100, 2026-12-06). Otherwise the absorbed form under
        the padding mask."""
        t = x.shape[1]
        start = cache.filled
        end = start + t
        if end > cache.max_len:
            raise ValueError(f"static MLA cache holds {cache.max_len} slots; {end} needed")
        cache.kv[:, start:end] = new_kv.to(cache.kv.dtype)
        cache.valid[:, start:end] = valid
        cache.pos.add_(t)
        kv_slots, valid_slots = cache.kv[:, :end], cache.valid[:, :end]
        if not bool(valid_slots.all()):  # one host sync per prefill chunk, never in a step
            w_uk, w_uv = self._absorbed_weights()
            query = self._absorbed_query(q_nope, q_rope, w_uk)
            o = self._attend_masked(query, kv_slots, valid_slots, t)
            return self._absorbed_out(x, o, w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1)
        o = key_segment_attention(
            q, None, None, (kv_slots,), (self.w_kvb.weight,), CachedLatentKeys,
            (self.n_heads, self.nope, self.kv_lora), self.prefill_key_segment, self.scale)
        return self._output(x, o)

    def new_cache(self, batch: int, capacity: int = 0) -> MLACache:
        """An empty decode cache (no tokens yet, room for `capacity`) on the layer's device."""
        weight = self.w_kva.weight
        return MLACache(
            weight.new_zeros(batch, capacity, self.kv_lora + self.rope),
            torch.zeros(batch, capacity, dtype=torch.bool, device=weight.device), 0,
        )

    def new_static_cache(self, batch: int, max_len: int) -> StaticMLACache:
        """An empty preallocated decode cache of max_len slots on the layer's device."""
        weight = self.w_kva.weight
        return StaticMLACache(
            weight.new_zeros(batch, max_len, self.kv_lora + self.rope),
            torch.zeros(batch, max_len, dtype=torch.bool, device=weight.device),
            torch.zeros((), dtype=torch.long, device=weight.device),
        )

    def init_weights(self, init_std: float, out_init_std: float) -> None:
        for lin in (self.w_qa, self.w_qb, self.w_kva, self.w_kvb, self.w_g):
            nn.init.trunc_normal_(lin.weight, std=init_std)
        nn.init.trunc_normal_(self.w_o.weight, std=out_init_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()

