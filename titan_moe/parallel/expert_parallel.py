"""Expert parallelism for the routed experts, applied from outside the model.

Each of the `ep` ranks of the expert-parallel group holds E/ep experts (the weights become
DTensors sharded on the expert dim over the ep mesh). The experts module keeps its contract,
`forward(z_sorted [M, ℓ], offs [E] int32 cumulative group ends) -> [M, out]` (rows from
offs[-1] on are padding, returned as zeros); under EP that forward becomes

    counts[e] = offs[e] - offs[e-1]              rows per global expert, this rank's tokens
    all-to-all counts                            each rank learns what it will receive
    all-to-all z                                 rows of experts e ∈ rank r go to rank r (latent z:
                                                 ℓ wide, not the model width d)
    permute (source rank, expert) -> (expert, source rank), run the local experts
    inverse permutation, all-to-all back         rows return in the caller's order

Uneven splits need the row counts on the host (one sync per MoE layer per pass), so this
forward runs eagerly. Both all-to-alls are differentiable: the backward sends gradients back
along the same splits.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_moe.model.moe import GroupedExperts


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all_to_all_single over the rows of x."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, the module's DTensor parameters read as their local shards.

    to_local() keeps autograd to the DTensor (gradients land on the sharded parameter); FSDP2
    swaps unsharded parameters in and out of `_parameters` the same way.
    """
    saved = dict(module._parameters)
    for name, p in saved.items():
        if isinstance(p, DTensor):
            module._parameters[name] = p.to_local()
    try:
        yield
    finally:
        module._parameters.update(saved)


class ExpertParallelGroupedExperts(GroupedExperts):
    """GroupedExperts whose forward dispatches rows to the rank holding their expert.

    Made by `apply_expert_parallel` (the instance's class is swapped, so parameter names and
    checkpoints stay those of GroupedExperts).
    """

    ep_group: dist.ProcessGroup

    def forward(self, z: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size(self.ep_group)
        n_experts = offs.numel()
        local_experts = n_experts // ep
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64)
        send_counts = counts.view(ep, local_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        # Rows at or past offs[-1] are the dispatch buffer's unused tail: they stay home.
        used = sum(in_splits)
        z_recv = all_to_all(z[:used], out_splits, in_splits, self.ep_group)

        # Received rows are ordered (source rank, local expert); the experts want (expert, source).
        segment = torch.arange(ep * local_experts, device=z.device).view(ep, local_experts)
        row_segment = segment.flatten().repeat_interleave(recv_counts.flatten().to(z.device))
        key = (row_segment % local_experts) * ep + row_segment // local_experts
        order = torch.sort(key, stable=True).indices
        local_offs = recv_counts.sum(0).cumsum(0).to(device=z.device, dtype=torch.int32)
        with _local_parameters(self):
            out_sorted = super().forward(z_recv.index_select(0, order), local_offs)
        out_recv = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)
        out = all_to_all(out_recv, in_splits, out_splits, self.ep_group)
        return torch.cat([out, out.new_zeros(z.shape[0] - used, *out.shape[1:])])


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Shard every GroupedExperts of `model` over `ep_mesh` (expert dim); return those modules."""
    ep = ep_mesh.size()
    experts_modules = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for experts in experts_modules:
        n_experts = experts.w13.shape[0]
        if n_experts % ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree = {ep} must divide n_experts = {n_experts}"
            )
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        experts.__class__ = ExpertParallelGroupedExperts
        experts.ep_group = ep_mesh.get_group()
    return experts_modules
