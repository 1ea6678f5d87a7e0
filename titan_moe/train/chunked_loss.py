"""Linear + cross-entropy over chunks of positions, so the [T, vocab] logits never exist at once.

    loss = Σ_t −log softmax(h_t Wᵀ)[y_t]        (sum; label −100 is ignored)

The forward keeps only h, W and the per-token log-sum-exp; the backward recomputes each chunk's
logits, dlogits = softmax − onehot, dh = dlogits W, dW += dlogitsᵀ h. Peak memory is one chunk
of fp32 logits (chunk × vocab × 4 bytes: 8192 × 32768 → 1 GiB) instead of T × vocab.

In training (`training.loss_chunk` > 0) the trainer runs the model inside `hidden_from_head`,
so the model returns the normed hidden states and `ChunkedCrossEntropy` applies the head's
weight by chunks. FSDP's hooks sit on the head's __call__, which still runs: its weight is
all-gathered for the loss (the head's unit keeps it unsharded after forward) and its gradient
reduce-scattered in backward.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

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
        matmul_dtype = hidden.dtype
        for s in range(0, hidden.shape[0], chunk):
            product = hidden[s : s + chunk] @ weight.T
            matmul_dtype = product.dtype  # autocast may pick a narrower one than the inputs'
            logits = product.to(wide)
            lse[s : s + chunk] = logits.logsumexp(-1)
            target = logits.gather(-1, safe[s : s + chunk, None]).squeeze(-1)
            total += ((lse[s : s + chunk] - target) * valid[s : s + chunk]).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.matmul_dtype = chunk, matmul_dtype
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        # The backward runs outside autocast: repeat the forward's matmul dtype by hand.
        w = weight.to(ctx.matmul_dtype)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros_like(weight, dtype=lse.dtype)
        valid = labels != IGNORE_INDEX
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk].to(ctx.matmul_dtype)
            d_logits = ((h @ w.T).to(lse.dtype) - lse[s : s + ctx.chunk, None]).exp()
            rows = torch.arange(h.shape[0], device=h.device)
            d_logits[rows, labels[s : s + ctx.chunk].clamp(min=0)] -= 1
            d_logits *= (grad * valid[s : s + ctx.chunk])[:, None]
            d_logits = d_logits.to(ctx.matmul_dtype)
            d_hidden[s : s + ctx.chunk] = (d_logits @ w).to(hidden.dtype)
            d_weight += (d_logits.T @ h).to(lse.dtype)
        return d_hidden, d_weight.to(weight.dtype), None, None


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                 chunk: int = CHUNK) -> Tensor:
    """Summed cross-entropy of logits hidden @ weightᵀ; hidden [..., D], weight [V, D]."""
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                            labels.reshape(-1), chunk)


@contextlib.contextmanager
def hidden_from_head(head: nn.Linear) -> Iterator[None]:
    """Inside, head(h) returns h: the model's output is the hidden state the head would read.

    The head's forward is replaced on the instance, so __call__ and the hooks on it (FSDP's
    unshard and reduce-scatter) still run, but no [T, vocab] product is computed.
    """
    previous = head.__dict__.get("forward")
    head.forward = _identity
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def _identity(hidden: Tensor) -> Tensor:
    return hidden


class ChunkedCrossEntropy:
    """The trainer's loss under `hidden_from_head(head)`: (hidden [B,T,D], labels [B,T]) ->
    summed cross-entropy of hidden @ head.weightᵀ, by chunks of `chunk` positions."""

    def __init__(self, head: nn.Linear, chunk: int) -> None:
        self.head, self.chunk = head, chunk

    def __call__(self, hidden: Tensor, labels: Tensor) -> Tensor:
        weight = self.head.weight
        if isinstance(weight, DTensor):
            raise RuntimeError("the LM head's weight is still sharded after forward: its FSDP "
                               "unit must not reshard after forward (parallelize.apply_fsdp)")
        return chunked_linear_cross_entropy(hidden, weight, labels, self.chunk)
