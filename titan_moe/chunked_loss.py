"""Linear + cross-entropy over chunks of positions, so the [T, vocab] logits never exist at once.

    loss = Σ_t −log softmax(h_t Wᵀ)[y_t]        (sum; label −100 is ignored)

The forward keeps only h, W and the per-token log-sum-exp; the backward recomputes each chunk's
logits, dlogits = softmax − onehot, dh = dlogits W, dW += dlogitsᵀ h. Peak memory is one chunk
of fp32 logits (chunk × vocab × 4 bytes: 8192 × 32768 → 1 GiB) instead of T × vocab.
"""

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK = 8192


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
        wide = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=wide)
        total = hidden.new_zeros((), dtype=wide)
        valid = labels != IGNORE_INDEX
        safe = labels.clamp(min=0)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.T).to(wide)
            lse[s : s + chunk] = logits.logsumexp(-1)
            target = logits.gather(-1, safe[s : s + chunk, None]).squeeze(-1)
            total += ((lse[s : s + chunk] - target) * valid[s : s + chunk]).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros_like(weight, dtype=lse.dtype)
        valid = labels != IGNORE_INDEX
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            d_logits = ((h @ weight.T).to(lse.dtype) - lse[s : s + ctx.chunk, None]).exp()
            rows = torch.arange(h.shape[0], device=h.device)
            d_logits[rows, labels[s : s + ctx.chunk].clamp(min=0)] -= 1
            d_logits *= (grad * valid[s : s + ctx.chunk])[:, None]
            d_logits = d_logits.to(hidden.dtype)
            d_hidden[s : s + ctx.chunk] = d_logits @ weight
            d_weight += (d_logits.T @ h).to(lse.dtype)
        return d_hidden, d_weight.to(weight.dtype), None, None


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                 chunk: int = CHUNK) -> Tensor:
    """Summed cross-entropy of logits hidden @ weightᵀ; hidden [..., D], weight [V, D]."""
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                            labels.reshape(-1), chunk)
