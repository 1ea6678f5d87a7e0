"""One token of the KDA recurrence, for decoding: the chunked entry points' semantics at T = 1."""

import torch


def recurrent_kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: q, k, g [B,H,K]; v [B,H,V]; beta [B,H]; state [B,H,K,V].

    Returns (o [B,H,V], new state), both in the state's dtype.
    """
    q, k, v, g, beta = (z.to(state.dtype) for z in (q, k, v, g, beta))
    decayed = state * g.exp().unsqueeze(-1)
    delta = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", decayed, k))
    state = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", state, q * scale), state
