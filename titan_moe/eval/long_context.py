"""Long-context evaluation at the end of a context stage: loss by position and a needle probe.

    loss by position   mean next-token loss of the tokens whose position inside their document
                       falls in [lo, hi), for the buckets 0–1K, 1K–8K, 8K–64K, 64K–256K,
                       256K–1M (clipped to the sequence length; empty buckets are left out)
    needle probe       a random key → value token phrase is written into corpus text at a depth
                       d ∈ [0, 1] of a context of L tokens; the context ends with the key again.
                       Scores: mean log-prob of the value tokens given the rest (teacher forced)
                       and accuracy (every value token is the argmax).
Random-token phrases need no tokenizer and cannot be guessed from the haystack. The model runs
once per sequence under no_grad with its head bypassed (`hidden_from_head`); logits are formed
from the hidden states LOSS_CHUNK positions at a time (the needle: only at the value tokens), so
no [T, vocab] tensor is ever held, which at 1M tokens would not fit.

Under context parallelism (`group`, the cp group of a model `apply_context_parallel` patched)
the ranks of the group hold the same rows and each runs its contiguous slab of every sequence
(`shard_sequence`). Per-token losses are all-gathered back into whole rows, so the buckets are
counted on global document positions; the needle context is padded at its end to whole KDA
chunks per rank (causal, so the padding changes no earlier position) and the hidden states at
the value tokens, held by one rank or two, are summed over the group (the other ranks add
zeros). Every rank of the group returns the same metrics.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE
from titan_moe.parallel.context_parallel import shard_sequence
from titan_moe.train.chunked_loss import hidden_from_head

POSITION_BUCKETS = (0, 1024, 8192, 65536, 262144, 1048576)
LOSS_CHUNK = 8192  # positions per cross-entropy call


@dataclass(frozen=True)
class NeedleSpec:
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int = 2
    key_tokens: int = 4
    value_tokens: int = 4


def document_positions(doc_ids: Tensor) -> Tensor:
    """[B, T] document index per token (nondecreasing) -> each token's position in its document."""
    t = doc_ids.shape[-1]
    index = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=-1).values


def _hidden(model: nn.Module, tokens: Tensor, doc_ids: Tensor | None = None) -> Tensor:
    """[B, T, D]: what the model's LM head would read."""
    with hidden_from_head(model.output):
        return model(tokens, doc_ids)


def _head_weight(model: nn.Module) -> Tensor:
    """The LM head's weight, gathered once if FSDP shards it."""
    weight = model.output.weight
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """float32 logits of some positions' hidden states."""
    return (hidden @ weight.to(hidden.dtype).T).float()


@torch.no_grad()
def token_losses(model: nn.Module, tokens: Tensor, labels: Tensor,
                 doc_ids: Tensor | None = None,
                 group: dist.ProcessGroup | None = None) -> Tensor:
    """[B, T] next-token cross-entropy of every position, in float32. With a cp `group`, the
    whole rows on every rank of it: each computes its slab's, then all-gathers them."""
    if group is not None:
        tokens, labels = shard_sequence(tokens, group), shard_sequence(labels, group)
        doc_ids = None if doc_ids is None else shard_sequence(doc_ids, group)
    hidden, weight = _hidden(model, tokens, doc_ids), _head_weight(model)
    losses = torch.cat([
        F.cross_entropy(_logits(hidden[:, s : s + LOSS_CHUNK], weight).flatten(0, 1),
                        labels[:, s : s + LOSS_CHUNK].flatten(), reduction="none"
                        ).view(tokens.shape[0], -1)
        for s in range(0, tokens.shape[1], LOSS_CHUNK)
    ], 1)
    if group is None:
        return losses
    slabs = [torch.empty_like(losses) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slabs, losses, group=group)
    return torch.cat(slabs, 1)


def loss_by_position(losses: Tensor, doc_ids: Tensor | None,
                     buckets: Sequence[int] = POSITION_BUCKETS) -> dict[str, float]:
    """Mean loss per document-position bucket, keyed `long_context/loss_pos_<lo>_<hi>`."""
    if doc_ids is None:
        doc_ids = torch.zeros(losses.shape, dtype=torch.long, device=losses.device)
    positions = document_positions(doc_ids)
    metrics = {}
    for lo, hi in zip(buckets[:-1], buckets[1:], strict=True):
        inside = (positions >= lo) & (positions < hi)
        if inside.any():
            metrics[f"long_context/loss_pos_{_short(lo)}_{_short(hi)}"] = float(
                losses[inside].double().mean())
    return metrics


def _hidden_at(model: nn.Module, tokens: Tensor, start: int,
               group: dist.ProcessGroup | None) -> Tensor:
    """[T - start, D]: the hidden states of one sequence tokens [T] from position `start` on."""
    if group is None:
        return _hidden(model, tokens[None])[0, start:]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = tokens.numel()
    padded = -(-length // (size * KDA_CHUNK_SIZE)) * size * KDA_CHUNK_SIZE
    # The padding is a document of its own after the context: causal layers never read it.
    doc_ids = (torch.arange(padded, device=tokens.device) >= length).int()[None]
    tokens = F.pad(tokens, (0, padded - length))[None]
    hidden = _hidden(model, shard_sequence(tokens, group), shard_sequence(doc_ids, group))[0]
    slab = padded // size
    lo, hi = max(start, rank * slab), min(length, (rank + 1) * slab)
    out = hidden.new_zeros(length - start, hidden.shape[-1])
    if lo < hi:
        out[lo - start : hi - start] = hidden[lo - rank * slab : hi - rank * slab]
    dist.all_reduce(out, group=group)  # one rank holds each position; the others add zeros
    return out


@torch.no_grad()
def needle_probe(model: nn.Module, haystack: Tensor, spec: NeedleSpec, vocab_size: int,
                 seed: int = 0, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Needle log-prob and accuracy per (length, depth), keyed `long_context/needle_*`; with a
    cp `group`, the same on every rank of it."""
    generator = torch.Generator().manual_seed(seed)
    phrase = spec.key_tokens + spec.value_tokens
    metrics, weight = {}, _head_weight(model)
    for length in spec.lengths:
        if length > haystack.numel() or length < 2 * phrase + spec.key_tokens:
            raise ValueError(f"needle length {length} must lie in "
                             f"[{2 * phrase + spec.key_tokens}, {haystack.numel()}]")
        for depth in spec.depths:
            logprobs, hits = [], []
            for _ in range(spec.trials):
                tokens, value_at = _needle_context(haystack, length, depth, spec, vocab_size,
                                                   generator)
                tokens = tokens.to(haystack.device)
                logits = _logits(_hidden_at(model, tokens[:-1], value_at - 1, group), weight)
                value = tokens[value_at:]
                logprobs.append(logits.log_softmax(-1).gather(-1, value[:, None]).mean())
                hits.append((logits.argmax(-1) == value).all().float())
            name = f"len{_short(length)}_depth{depth:g}"
            metrics[f"long_context/needle_logprob/{name}"] = float(torch.stack(logprobs).mean())
            metrics[f"long_context/needle_acc/{name}"] = float(torch.stack(hits).mean())
    return metrics


def _needle_context(haystack: Tensor, length: int, depth: float, spec: NeedleSpec,
                    vocab_size: int, generator: torch.Generator) -> tuple[Tensor, int]:
    """(context of `length` tokens ending in key + value, index of the first value token)."""
    key = torch.randint(0, vocab_size, (spec.key_tokens,), generator=generator)
    value = torch.randint(0, vocab_size, (spec.value_tokens,), generator=generator)
    needle = torch.cat([key, value])
    text = haystack[: length - 2 * needle.numel()].cpu()
    at = round(depth * text.numel())
    # The needle again at the end: its key is the query, its value what is scored.
    tokens = torch.cat([text[:at], needle, text[at:], needle])
    return tokens, length - spec.value_tokens


def long_context_metrics(model: nn.Module, tokens: Tensor, labels: Tensor,
                         doc_ids: Tensor | None, spec: NeedleSpec, vocab_size: int,
                         buckets: Sequence[int] = POSITION_BUCKETS,
                         group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Both evaluations on one batch of corpus windows (its first row is the haystack). With
    context parallelism, `group` is the cp group and tokens, labels and doc_ids are the whole
    rows it shares (not a rank's slab)."""
    was_training = model.training
    model.eval()
    # Eager where training compiled the model: one no_grad forward per sequence, at shapes (the
    # needle lengths) and in a mode (eval, no_grad) training never compiled, which would
    # recompile every sublayer with dynamic shapes (the AttnRes fusion pass takes static ones).
    with torch.compiler.set_stance("force_eager"):
        try:
            metrics = loss_by_position(token_losses(model, tokens, labels, doc_ids, group),
                                       doc_ids, buckets)
            metrics.update(needle_probe(model, tokens[0], spec, vocab_size, group=group))
        finally:
            model.train(was_training)
    return metrics


def _short(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)
