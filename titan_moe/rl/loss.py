"""GRPO: group-relative advantages and the token-level policy loss with a KL term.

    A_i   = (r_i − mean_group r) / (std_group r + eps)          same A on every action token of i
    loss  = Σ_{i,t ∈ actions} [ −A_i · log π(a_t) + β · KL_t ] / Σ_i |actions_i|
    KL_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1          (k3 estimator, ≥ 0, unbiased)

One on-policy gradient step per rollout batch, so the PPO ratio is 1 and needs no clipping.
Token log-probabilities come from one training forward when a row fits in `chunk_len`; longer
rows run in chunks of `chunk_len` through the decode cache, the KDA state, conv taps and MLA
latent cache carried from chunk to chunk with their gradients (so the loss and gradients equal
the unchunked ones), each chunk activation-checkpointed so only chunk boundaries stay in memory.
"""

import torch
from torch.utils.checkpoint import checkpoint

from titan_moe.model.kda import KDAState
from titan_moe.model.mla import MLACache
from titan_moe.model.model import TitanMoE


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] ordered group by group (N = n_groups · group_size) -> advantages [N]."""
    grouped = rewards.view(-1, group_size).double()
    centred = grouped - grouped.mean(1, keepdim=True)
    std = grouped.std(1, unbiased=False, keepdim=True) if group_size > 1 else 1.0
    return (centred / (std + eps)).view(-1).to(rewards.dtype)


def uniform_group_share(rewards: torch.Tensor, group_size: int) -> float:
    """The share of groups whose rewards are all equal: their advantages are 0, so they add no
    policy gradient (an update of only such groups moves the policy by its KL term alone)."""
    grouped = rewards.view(-1, group_size)
    return float((grouped == grouped[:, :1]).all(1).double().mean())


def _token_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logp_all = torch.log_softmax(logits.float(), -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _flatten(cache: list) -> list[torch.Tensor]:
    flat = []
    for c in cache:
        flat += [c.recurrent, c.conv] if isinstance(c, KDAState) else list(c.filled())
    return flat


def _rebuild(like: list, flat: list[torch.Tensor]) -> list:
    out, i = [], 0
    for c in like:
        if isinstance(c, KDAState):
            out.append(KDAState(flat[i], flat[i + 1]))
            i += 2
        else:
            out.append(MLACache(flat[i], flat[i + 1], flat[i].shape[1]))
            i += 2
    return out


def token_logprobs(
    model: TitanMoE, tokens: torch.Tensor, valid: torch.Tensor, chunk_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(tokens[:, t+1] | tokens[:, :t+1]) and the entropy there, both [B, T-1] fp32.

    tokens, valid [B, T] are right-padded rows; positions past a row's end are garbage (mask
    them). Rows longer than chunk_len run chunked with the decode state carried (see above).
    """
    targets = tokens[:, 1:]
    if tokens.shape[1] <= chunk_len:
        return _token_stats(model(tokens)[:, :-1], targets)
    template = model.new_cache(tokens.shape[0])
    flat = _flatten(template)

    def run_chunk(chunk, chunk_valid, chunk_targets, *state):
        cache = _rebuild(template, list(state))
        logits = model(chunk, cache=cache, valid=chunk_valid)[:, : chunk_targets.shape[1]]
        return (*_token_stats(logits, chunk_targets), *_flatten(cache))

    logps, entropies = [], []
    for start in range(0, tokens.shape[1] - 1, chunk_len):
        end = start + chunk_len
        logp, entropy, *flat = checkpoint(
            run_chunk, tokens[:, start:end], valid[:, start:end], targets[:, start:end], *flat,
            use_reentrant=False,
        )  # fmt: skip
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps, 1), torch.cat(entropies, 1)


def grpo_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    n_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp, ref_logp, mask [B, T-1] (mask: action tokens), advantages [B] -> (loss, KL sum).

    n_tokens: the normaliser, the action tokens of the whole batch when this is a micro-batch
    (default: this call's)."""
    mask = mask.to(logp.dtype)
    n_tokens = max(int(mask.sum()), 1) if n_tokens is None else n_tokens
    log_ratio = ref_logp - logp
    kl = torch.exp(log_ratio) - log_ratio - 1
    per_token = -advantages.unsqueeze(-1) * logp + kl_coef * kl
    return (per_token * mask).sum() / n_tokens, (kl.detach() * mask).sum()
