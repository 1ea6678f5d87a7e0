"""Token-by-token KDA recurrence: the reference every faster path is checked against.

Per head, with state S in R^{d_k x d_v}, per-channel log-decay g_t <= 0 and beta_t in (0, 1):
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale * q_t)
With `cu_seqlens` (fla semantics, batch 1) the state restarts at every document start from that
document's initial state (or zero) and each document's final state is returned.
"""

import torch
from torch import Tensor


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
