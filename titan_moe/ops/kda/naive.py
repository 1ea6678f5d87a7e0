"""The plain-PyTorch references of KDA: the token loop and the chunked form.

`naive_recurrent_kda`, token by token, is the reference every faster path is checked against.
Per head, with state S in R^{d_k x d_v}, per-channel log-decay g_t <= 0 and beta_t in (0, 1):
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale * q_t)
With `cu_seqlens` (fla semantics, batch 1) the state restarts at every document start from that
document's initial state (or zero) and each document's final state is returned.

`chunk_kda_torch` is the chunked form in plain PyTorch, laid out the way the Triton kernels are
(and the path on CPU).

For a chunk of C tokens with incoming state S0, G = cumsum(g) within the chunk, Gamma = exp(G):
    L[r,j]    = beta_r sum_c k_rc k_jc exp(G_rc - G_jc)          j < r
    A_qk[r,j] = sum_c q_rc k_jc exp(G_rc - G_jc)                  j <= r
    M = (I + L)^{-1} Diag(beta),   W = M (Gamma * K),   U = M V,   V~ = U - W S0
    O = (Gamma * Q) S0 + A_qk V~,  S_next = Diag(gamma_C) S0 + ((gamma_C / Gamma) * K)^T V~
which equals the recurrence S_t = S' + beta_t k_t (v_t - S'^T k_t)^T, S' = Diag(exp(g_t)) S_{t-1},
o_t = S_t^T (scale q_t) exactly.

Packed documents are handled by masking, never by data-dependent shapes: entries of L and A_qk
between different documents are zero, each token's "base state" is the carried S0 when its
document began before the chunk and its document's initial state (or zero) otherwise, with the
decay Gamma referenced to that base (the document start), and S_next follows the chunk's last
document only.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_moe.ops.kda.varlen import doc_index_from_cu_seqlens, validate_documents

# Sub-tile of the intra-chunk GEMMs. Referencing the decay at a tile's first row bounds the
# growing factor by 15 * |g_min| = 75 nats for g >= -5, inside fp32's ~87-nat range; a tile of
# 18 tokens would not be.
SUBTILE = 16


def chunk_kda_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    doc_ids: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; g must lie in [-5, 0] for fp32 safety.

    Documents: `cu_seqlens` [N+1] (B == 1, fla semantics; initial and final states are per
    document, [N,H,K,V]) or `doc_ids` [B,T] (nondecreasing per row; the state resets whenever
    the id changes; initial_state [B,H,K,V] seeds each row's first document, the final state is
    each row's end state). Without documents states are [B,H,K,V].
    Returns (o [B,T,H,V] in q's dtype, final state in float32/float64 or None).
    """
    validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, doc_ids, chunk_size)
    batch, seq_len, heads, d_k = q.shape
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = d_k**-0.5 if scale is None else scale
    n_chunks = -(-seq_len // chunk_size)
    pad = n_chunks * chunk_size - seq_len

    def to_chunks(x: Tensor) -> Tensor:
        # Padding tokens (g = 0, beta = 0, k = 0) leave the state untouched.
        x = F.pad(x.to(compute), (0, 0, 0, 0, 0, pad))
        return x.view(batch, n_chunks, chunk_size, heads, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(g)
    beta = to_chunks(beta.unsqueeze(-1))  # [B,H,NC,C,1]

    if cu_seqlens is not None:
        doc = doc_index_from_cu_seqlens(cu_seqlens, seq_len)[None]
    elif doc_ids is not None:
        doc = doc_ids.long()
    else:
        doc = torch.zeros(batch, seq_len, dtype=torch.long, device=q.device)
    doc = torch.cat([doc, doc[:, -1:].expand(batch, pad)], 1)
    doc = doc.view(batch, 1, n_chunks, chunk_size)  # broadcasts over heads
    # Document of the token just before each chunk. With cu_seqlens nothing precedes the first
    # chunk (every document starts from its own initial state); otherwise a row's first document
    # continues from initial_state.
    before_first = doc[..., :1, 0]
    if cu_seqlens is not None:
        before_first = torch.full_like(before_first, -1)
    doc_before = torch.cat([before_first, doc[..., :-1, -1]], -1)
    continues = (doc == doc_before[..., None]).to(compute).unsqueeze(-1)  # [B,1,NC,C,1]
    same_doc = doc[..., :, None] == doc[..., None, :]  # [B,1,NC,C,C]

    G = g.cumsum(-2)
    # Decay referenced to each token's base: the chunk start, or its document's start when the
    # document begins inside the chunk (position = count of earlier-document tokens in the chunk).
    doc_start = (doc[..., None, :] < doc[..., :, None]).sum(-1)
    G_before = torch.cat([torch.zeros_like(G[..., :1, :]), G[..., :-1, :]], -2)
    G_base = G_before.gather(-2, doc_start.unsqueeze(-1).expand_as(G))
    decay_from_base = torch.exp(G - G_base)  # Gamma, <= 1

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    A_qk = _decayed_products(q, k, G) * (causal & same_doc)
    L = beta * _decayed_products(k, k, G) * (strict & same_doc)
    M = _unit_lower_inverse(L) * beta.mT
    W = M @ (decay_from_base * k)
    U = M @ v
    Q_base = decay_from_base * q

    in_last_doc = (doc == doc[..., -1:]).to(compute).unsqueeze(-1)
    K_to_end = k * torch.exp(G[..., -1:, :] - G) * in_last_doc  # (gamma_C / Gamma) * K, last doc
    carry = continues[..., -1, :] * decay_from_base[..., -1, :]  # [B,H,NC,K]

    per_doc_init = cu_seqlens is not None and initial_state is not None
    if per_doc_init:
        # Tokens of documents that start inside a chunk read their document's initial state.
        # Gathering it per token costs T*H*K*V memory: acceptable for this reference/prefill path.
        fresh = 1 - continues
        init = initial_state.to(compute)[doc.view(-1)]
        init = init.view(n_chunks, chunk_size, heads, d_k, -1).permute(2, 0, 1, 3, 4)[None]
        U = U - torch.einsum("bhnck,bhnckv->bhncv", fresh * W, init)
        O_init = torch.einsum("bhnck,bhnckv->bhncv", fresh * Q_base, init)
        fresh_end = fresh[..., -1:, :] * decay_from_base[..., -1:, :]
        S_init_end = fresh_end.mT * init[..., -1, :, :]  # [B,H,NC,K,V]

    if initial_state is not None and cu_seqlens is None:
        state = initial_state.to(compute)
    else:
        state = q.new_zeros(batch, heads, d_k, v.shape[-1])
    W_carried = continues * W
    chunk_states, v_new = [], []
    for c in range(n_chunks):
        chunk_states.append(state)
        v_c = U[:, :, c] - W_carried[:, :, c] @ state
        v_new.append(v_c)
        state = carry[:, :, c, :, None] * state + K_to_end[:, :, c].mT @ v_c
        if per_doc_init:
            state = state + S_init_end[:, :, c]
    chunk_states = torch.stack(chunk_states, 2)
    v_new = torch.stack(v_new, 2)

    o = (continues * Q_base) @ chunk_states + A_qk @ v_new
    if per_doc_init:
        o = o + O_init
    o = o.permute(0, 2, 3, 1, 4).reshape(batch, n_chunks * chunk_size, heads, -1)[:, :seq_len]

    if not output_final_state:
        final = None
    elif cu_seqlens is None:
        final = state
    else:
        final = _document_final_states(
            cu_seqlens, initial_state, chunk_states, k, v_new, G, G - G_base, doc, chunk_size
        )
    return o.to(out_dtype), final


def _decayed_products(rows: Tensor, k: Tensor, G: Tensor) -> Tensor:
    """sum_c rows_rc k_jc exp(G_rc - G_jc) as 16-token tile GEMMs; [..., C, K] -> [..., C, C].

    Each row tile i is referenced at its first row n_i: exp(G_r - G_n) * exp(G_n - G_j). The row
    factor is <= 1; the column factor is <= 1 left of the tile and <= 75 nats on the diagonal
    tile. Columns right of the row tile would overflow, so they are zeroed before the exp (the
    caller masks them anyway, as well as j > r inside the diagonal tile).
    """
    chunk_size = G.shape[-2]
    n_tiles = chunk_size // SUBTILE
    G_tiles = G.unflatten(-2, (n_tiles, SUBTILE))
    G_ref = G_tiles[..., :1, :]  # [..., NT, 1, K]
    row_op = rows.unflatten(-2, (n_tiles, SUBTILE)) * torch.exp(G_tiles - G_ref)
    tile_end = SUBTILE * torch.arange(1, n_tiles + 1, device=G.device)
    reach = (torch.arange(chunk_size, device=G.device) < tile_end[:, None]).unsqueeze(-1)
    col_exponent = torch.where(reach, G_ref - G.unsqueeze(-3), 0.0)  # [..., NT, C, K]
    col_op = k.unsqueeze(-3) * torch.exp(col_exponent) * reach
    return (row_op @ col_op.mT).flatten(-3, -2)


def _unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^{-1} for strictly lower-triangular L [..., C, C] by blocked forward substitution.

    Blocks double in size, 1, 2, 4, ...: once the diagonal blocks of size b are inverted (X),
    joining pairs of them uses [[A, 0], [E, D]]^{-1} = X - X E' X, where E' keeps only the
    couplings E between the two halves of each 2b-block. Levels below 16 invert the diagonal
    16x16 tiles; the rest merge tiles, as the kernels do. Substitution rather than the Neumann
    product (I-L)(I+L^2)(I+L^4)...: powers of L grow combinatorially when keys align (|L^m| up to
    binom(C-1, m)) and their cancellation costs fp32 digits. Masked GEMMs keep the traced graph
    small (no cat/stack of rows).
    """
    size = L.shape[-1]
    index = torch.arange(size, device=L.device)
    inv = torch.eye(size, dtype=L.dtype, device=L.device).expand_as(L)
    block = 1
    while block < size:
        same_pair = (index[:, None] // (2 * block)) == (index[None, :] // (2 * block))
        upper_row = (index[:, None] // block) % 2 == 1
        lower_col = (index[None, :] // block) % 2 == 0
        coupling = L * (same_pair & upper_row & lower_col)
        inv = inv - inv @ coupling @ inv
        block *= 2
    return inv


def _document_final_states(
    cu_seqlens: Tensor,
    initial_state: Tensor | None,
    chunk_states: Tensor,
    k: Tensor,
    v_new: Tensor,
    G: Tensor,
    G_from_base: Tensor,
    doc: Tensor,
    chunk_size: int,
) -> Tensor:
    """State after each document's last token, [N,H,K,V]; chunked tensors have batch 1.

    For document n ending at position l of chunk c: Diag(exp(G_l - G_base)) base +
    sum_{j <= l, doc j = n} (exp(G_l - G_j) k_j) v~_j^T, gathered with static shapes (N fixed).
    """
    n_docs = cu_seqlens.numel() - 1
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    last = (ends - 1).clamp(min=0)
    chunk, pos = last // chunk_size, last % chunk_size
    k, v_new, G = k[0][:, chunk], v_new[0][:, chunk], G[0][:, chunk]  # [H,N,C,*]
    G_from_base, chunk_states = G_from_base[0][:, chunk], chunk_states[0][:, chunk]
    at_end = pos.view(1, n_docs, 1, 1).expand(G.shape[0], n_docs, 1, G.shape[-1])
    G_end = G.gather(-2, at_end)
    G_end_from_base = G_from_base.gather(-2, at_end).squeeze(-2)  # [H,N,K]

    ids = torch.arange(n_docs, device=doc.device)
    positions = torch.arange(chunk_size, device=doc.device)
    mask = (doc[0, 0][chunk] == ids[:, None]) & (positions <= pos[:, None])
    mask = mask.unsqueeze(-1)  # [N,C,1]
    decay = torch.exp(torch.where(mask, G_end - G, 0.0)) * mask
    local = (decay * k).mT @ v_new

    if initial_state is None:
        init = torch.zeros_like(local)
    else:
        init = initial_state.to(local.dtype).transpose(0, 1)
    began_earlier = (starts < chunk * chunk_size).view(n_docs, 1, 1)
    base = torch.where(began_earlier, chunk_states, init)
    state = G_end_from_base.exp().unsqueeze(-1) * base + local
    state = torch.where((ends > starts).view(n_docs, 1, 1), state, init)
    return state.transpose(0, 1)


def validate_kda_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    doc_ids: Tensor | None,
    chunk_size: int,
) -> None:
    """Raise ValueError, naming the argument, for inputs chunked KDA cannot take."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B,T,H,K], got {list(q.shape)}")
    batch, seq_len, heads, d_k = q.shape
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must match q's shape {list(q.shape)}, got {list(x.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must be [B,T,H,V] with B,T,H = {[batch, seq_len, heads]}, got {list(v.shape)}"
        )
    if beta.shape != q.shape[:3]:
        raise ValueError(
            f"beta must be [B,T,H] = {[batch, seq_len, heads]}, got {list(beta.shape)}"
        )
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if chunk_size <= 0 or chunk_size % SUBTILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUBTILE}, got {chunk_size}")
    validate_documents(batch, seq_len, cu_seqlens, doc_ids)
    if initial_state is not None:
        n_states = cu_seqlens.numel() - 1 if cu_seqlens is not None else batch
        expected = [n_states, heads, d_k, v.shape[-1]]
        if list(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must be [N,H,K,V] = {expected}, got {list(initial_state.shape)}"
            )
        if not initial_state.dtype.is_floating_point:
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; states [N,H,K,V].

    Returns (o [B,T,H,V] in q's dtype, final state or None). Computes in float64 for float64
    inputs, else float32. A Python loop with host syncs: a reference, not a training path.
    """
    batch, seq_len, heads, d_k = q.shape
    d_v = v.shape[-1]
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = d_k**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    q = q * scale

    if cu_seqlens is None:
        segments = [(b, 0, seq_len) for b in range(batch)]
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of 1, got batch {batch}")
        offsets = cu_seqlens.tolist()
        segments = [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]

    outputs: list[list[Tensor]] = [[] for _ in range(batch)]
    final_states = []
    for n, (b, start, end) in enumerate(segments):
        if initial_state is None:
            state = q.new_zeros(heads, d_k, d_v)
        else:
            state = initial_state[n].to(compute)
        for t in range(start, end):
            state = state * g[b, t].exp()[..., None]
            prediction = torch.einsum("hkv,hk->hv", state, k[b, t])
            delta = beta[b, t, :, None] * (v[b, t] - prediction)
            state = state + k[b, t, :, :, None] * delta[:, None, :]
            outputs[b].append(torch.einsum("hkv,hk->hv", state, q[b, t]))
        final_states.append(state)

    o = torch.stack([torch.stack(row) for row in outputs]).to(out_dtype)
    return o, torch.stack(final_states) if output_final_state else None
