"""Context parallelism: one sequence split into contiguous shards over the ranks of a group.

Applied from outside the model (`apply_context_parallel`), per mixer instance:
  KDA conv    each rank prepends the last K−1 projected tokens of the previous shard (the halo)
              and runs the short conv (conv, SiLU, per-head norm) on the extended shard.
  KDA state   over a shard the state map is affine, S_out = M S_in + S_local, with M [K,K]
              (the product of (I − β k kᵀ) Diag(e^g), zero once a document starts in the shard).
              One chunk_kda pass over v_aug = [v | 0_K] from S_aug = [0 | I] returns
              final = [S_local | M] and outputs [o_local | P_tᵀ q_t], so o_t = o_local +
              S_inᵀ P_tᵀ q_t. The ranks all-gather (S_local, M) and each combines the earlier
              shards with an exclusive scan, so all ranks run KDA at once; the cost is a pass
              with V + K value columns instead of V, plus a gather of R·[B,H,K,V+K] floats.
  MLA         the latents [c_kv | k_rope] are all-gathered (not the per-head K and V) and each
              rank attends its queries to the causal prefix, with document masking. Contiguous
              shards leave causal attention unbalanced: the last rank has the most keys.
  AttnRes, MoE, norms and the head are per token and need nothing.
Collectives are the autograd-aware functional ones, so the backward is exact. Gradients of the
parameters are each rank's share of the loss: sum them over the group (FSDP over dp×cp does).

Under torch.compile the three steps stay eager (`torch.compiler.disable`): the mixer compiles
in pieces around them (parallelize.apply_compile drops fullgraph for the mixers under CP), and
everything else compiles as without CP. Traced into the graph, the collectives deadlocked: the
steps branch on the rank, so each rank compiles its own graph, and the partitioner is then free
to place a collective differently per rank. With Inductor one rank's compiled KDA forward held
the reduce-scatter of the gathered states' gradient (on rank 0 that gradient is known zero: no
shard before it), while the other rank issued it in the backward. Gloo and NCCL match
collectives by order, so the ranks must issue the same ones in the same order, which eager
autograd does (the same program on every rank, the rank masking values rather than removing
steps).

In training (`parallelism.context_parallel_degree`), parallelize.py applies this over the cp
mesh and the trainer feeds each rank `shard_batch` of the batch its cp group shares: tokens,
labels and doc_ids cut into the same contiguous slabs. The doc ids stay the row's own (global)
ones, so document masking and KDA's state restarts see documents that cross a slab edge. No
position ids are needed: MLA is NoPE and KDA's only order is its recurrence, which the state
scan above carries across slabs. The loss is each rank's slab sum over the global token count,
which the trainer counts on the whole rows, so the ranks' losses add up to the global mean.
"""

from functools import partial, wraps

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.ops.kda import chunk_kda_fused_gate
from titan_moe.ops.short_conv import short_conv


def shard_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """This rank's contiguous shard of x along `dim` (the sequence must split evenly)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by the "
                         f"context-parallel degree {size}")
    return x.chunk(size, dim)[rank].contiguous()


def shard_batch(input_dict: dict[str, Tensor], labels: Tensor, group: dist.ProcessGroup
                ) -> tuple[dict[str, Tensor], Tensor]:
    """This rank's slab of a text batch: {"input", "doc_ids"?} [B, T] and labels [B, T]."""
    extra = set(input_dict) - {"input", "doc_ids"}
    if extra:
        raise ValueError(f"context parallelism shards text batches only; this batch also has "
                         f"{sorted(extra)}")
    return ({k: shard_sequence(v, group) for k, v in input_dict.items()},
            shard_sequence(labels, group))


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every KDA and MLA mixer of `model` work on its shard of a sequence split over group.

    The model is then called with this rank's shard of tokens and doc_ids (`shard_sequence`);
    doc_ids must be the global ones (comparable across shards).
    """
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            if module.seq_segment:
                # Segments pass the state and the conv taps within one rank's sequence; the
                # exchanged steps below see each call as a whole shard.
                raise ValueError(f"context parallelism does not support KDA segments "
                                 f"(titan_moe.seq_segment = {module.seq_segment}); allowed: 0")
            module.sequence_conv_act = partial(_eager(_conv_act_with_halo), group)
            module.sequence_recurrence = partial(_eager(_recurrence_across_shards), group)
        elif isinstance(module, GatedMLA):
            module.latent_prefix = partial(_eager(_gathered_latent_prefix), group,
                                           module.kv_lora)


def _eager(step):
    """A graph break under torch.compile: the collectives run in the order the program issues
    them on every rank (see the module docstring). The outputs are returned as tensors of their
    own, not views: the compiled code after the break rebuilds a view input from its base, which
    fails for the gathered latents' view at batch 1 (a reshape of a transpose)."""

    @wraps(step)
    def call(*args, **kwargs):
        out = step(*args, **kwargs)
        return tuple(map(_own, out)) if isinstance(out, tuple) else _own(out)

    return torch.compiler.disable(call, recursive=True)


def _own(x: Tensor | None) -> Tensor | None:
    return x.clone() if isinstance(x, Tensor) and x._base is not None else x


def has_context_parallel(module: nn.Module) -> bool:
    """Whether module holds a mixer `apply_context_parallel` patched (it compiles in pieces)."""
    return any(isinstance(m, (KimiDeltaAttention, GatedMLA)) and
               any(isinstance(getattr(m, name, None), partial)
                   for name in ("sequence_conv_act", "sequence_recurrence", "latent_prefix"))
               for m in module.modules())


# torch 2.13 renamed the autograd-aware gather; 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or \
    funcol.all_gather_tensor_autograd


def _gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[R, *x.shape]: x of every rank, differentiable (the backward reduce-scatters).

    Every rank must use every gathered tensor in its loss, or the backward collective runs on
    some ranks only and hangs: the callers below build the same graph on every rank, masking
    what a rank does not need instead of skipping it.
    """
    size = dist.get_world_size(group)
    return _all_gather(x.contiguous(), 0, group).view(size, *x.shape)


def _local_docs(x: Tensor, doc_ids: Tensor | None) -> Tensor:
    return torch.zeros(x.shape[:2], dtype=torch.long, device=x.device) if doc_ids is None \
        else doc_ids.long()


def _conv_act_with_halo(
    group: dist.ProcessGroup, x: Tensor, weight: Tensor, doc_ids: Tensor | None,
    head_dim: int | None,
) -> Tensor:
    """`short_conv` of this rank's shard: over [halo | shard], the halo rows then cut off (SiLU
    and the norm are per token; the halo's gradient flows back through the gather)."""
    halo = weight.shape[-1] - 1
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] < halo:
        raise ValueError(f"a context-parallel shard of {x.shape[1]} tokens is shorter than the "
                         f"conv halo ({halo})")
    docs = _local_docs(x, doc_ids)
    tails = _gather(x[:, x.shape[1] - halo:], group)
    tail_docs = _gather(docs[:, docs.shape[1] - halo:], group)
    # A ring: rank 0 takes the last rank's tail with document -1, so the conv drops its taps.
    prev = tails[(rank - 1) % size]
    prev_docs = tail_docs[(rank - 1) % size] if rank > 0 else torch.full_like(tail_docs[0], -1)
    y = short_conv(torch.cat([prev, x], 1), weight, torch.cat([prev_docs, docs], 1), head_dim)
    return y[:, halo:]


def _recurrence_across_shards(
    group: dist.ProcessGroup, q: Tensor, k: Tensor, v: Tensor, g_raw: Tensor, A_log: Tensor,
    dt_bias: Tensor, beta: Tensor, g_min: float, doc_ids: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    batch, _, heads, d_k = q.shape
    d_v = v.shape[-1]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    state_aug = torch.cat([
        q.new_zeros(batch, heads, d_k, d_v, dtype=torch.float32),
        torch.eye(d_k, device=q.device).expand(batch, heads, d_k, d_k),
    ], -1)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:3], d_k)], -1)
    o_aug, final = chunk_kda_fused_gate(q, k, v_aug, g_raw, A_log, dt_bias, beta, g_min,
                                        initial_state=state_aug, output_final_state=True,
                                        doc_ids=doc_ids, backend=backend)
    o_local, o_through_start = o_aug.split([d_v, d_k], -1)
    finals = _gather(final, group)  # [R, B, H, K, V + K]
    docs = _local_docs(q, doc_ids)
    bounds = _gather(torch.stack([docs[:, 0], docs[:, -1]]), group)  # [R, 2, B]
    state_in = final.new_zeros(batch, heads, d_k, d_v)
    for r in range(size - 1):  # exclusive scan; steps at or past this rank are masked out
        s_local, transition = finals[r].split([d_v, d_k], -1)
        continues = (bounds[r, 1] == bounds[r + 1, 0]).to(state_in.dtype).view(batch, 1, 1, 1)
        step = continues * (transition @ state_in + s_local)
        state_in = step if r < rank else step * 0 + state_in
    through_start = torch.einsum("bthk,bhkv->bthv", o_through_start.float(), state_in)
    o = o_local + through_start.to(o_local.dtype)
    s_local, transition = finals[rank].split([d_v, d_k], -1)
    return o, transition @ state_in + s_local


def _gathered_latent_prefix(
    group: dist.ProcessGroup, kv_lora: int, latent: Tensor, doc_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    rank = dist.get_rank(group)
    batch, length, width = latent.shape
    prefix = (rank + 1) * length
    latents = _gather(latent, group).transpose(0, 1).reshape(batch, -1, width)[:, :prefix]
    docs = _gather(_local_docs(latent, doc_ids), group).transpose(0, 1).reshape(batch, -1)
    c_kv, k_rope = latents.split([kv_lora, width - kv_lora], dim=-1)
    return c_kv, k_rope, docs[:, :prefix]
