"""A tiny titan_moe training loop, single-process or under torchtitan's ParallelDims on gloo.

Every run starts from the same weights (one seeded init of the full model, then sharded) and
sees the same global batch per step (data rank r of D reads rows r·B/D .. (r+1)·B/D - 1; with
context parallelism the cp ranks of a data rank take the trainer's `shard_batch` slabs of its
rows). The loss is the token-mean cross entropy over the global batch, as the trainer computes
it: each rank backpropagates sum(CE) / global tokens (the trainer's chunked loss when
`loss_chunk` > 0) and FSDP sums the gradients over its fsdp dim (dp_shard × cp).
"""

import math
import os
import socket
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as tt_dist_utils

from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.parallel.context_parallel import shard_batch
from titan_moe.parallel.parallelize import parallelize_titan_moe
from titan_moe.train.chunked_loss import ChunkedCrossEntropy, hidden_from_head
from titan_moe.train.config import job_config_class
from titan_moe.train.optimizer import all_reduce_qb_stats
from titan_moe.train.platform import use_platform
from titan_moe.train.step_guard import FiniteStepGuard
from titan_moe.train.trainer import exit_past_gloo_threads

_torchtitan_clip_grad_norm_ = tt_dist_utils.clip_grad_norm_

GLOBAL_ROWS = 4
SEQ_LEN = 64
LR = 1e-3


def tiny_args() -> TitanMoEArgs:
    """3 layers: dense KDA, MoE KDA, MoE MLA; 8 experts top-2; d 64."""
    return TitanMoEArgs(
        vocab_size=128, dim=64, n_layers=3, mla_layers=(3,), dense_hidden=128,
        attn_res_block_size=2, n_heads=2, head_dim=32, kda_gate_rank=16,
        mla_n_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_experts=8, top_k=2, n_shared_experts=1,
        shared_hidden=32, latent_dim=32, expert_hidden=32, max_seq_len=SEQ_LEN,
    ).validate()


@dataclass
class Layout:
    world_size: int = 1
    ep: int = 1
    cp: int = 1
    seq_len: int = SEQ_LEN
    loss_chunk: int = 0
    ac: str = "none"
    selective_ac_option: str = "2"
    sharding: str = "fsdp2"
    param_dtype: str = "float32"
    compile_backend: str | None = None
    simple_fsdp_passes: str = "none"
    # The fused AdamW under the step guard (titan_moe/train/step_guard.py: the clip inside the
    # kernel); otherwise torchtitan's clip and the for-loop AdamW.
    fused: bool = False
    max_norm: float = 1.0
    name: str = field(default="")


def global_batch(vocab: int, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch (tokens [B, T+1], doc ids [B, T]), fed every step: memorising it makes
    the loss fall within 5 steps. A second document starts at 5/8 of each row, so under cp = 2
    one document crosses the slab edge."""
    g = torch.Generator().manual_seed(1000)
    tokens = torch.randint(vocab, (GLOBAL_ROWS, seq_len + 1), generator=g)
    doc_ids = (torch.arange(seq_len) >= seq_len * 5 // 8).int().expand(GLOBAL_ROWS, -1)
    return tokens, doc_ids


def build_model() -> TitanMoE:
    torch.manual_seed(0)
    model = TitanMoE(tiny_args())
    model.init_weights()
    return model


def job_config(layout: Layout):
    config = job_config_class(TitanMoEArgs)()
    config.activation_checkpoint.mode = layout.ac
    config.activation_checkpoint.selective_ac_option = layout.selective_ac_option
    config.parallelism.sharding = layout.sharding
    config.parallelism.expert_parallel_degree = layout.ep
    config.parallelism.context_parallel_degree = layout.cp
    config.training.loss_chunk = layout.loss_chunk
    config.training.mixed_precision_param = layout.param_dtype
    config.training.mixed_precision_reduce = "float32"
    config.compile.enable = layout.compile_backend is not None
    config.compile.backend = layout.compile_backend or "inductor"
    config.parallelism.simple_fsdp_passes = layout.simple_fsdp_passes
    return config


def train(layout: Layout, steps: int = 5) -> dict:
    """Per step: the global loss, the grad norm before clipping and that of the gradients the
    optimizer used, and each router's QB bias after the step."""
    model = build_model()
    distributed = layout.world_size > 1
    group, ep_enabled = None, False
    cp_group, dp_rank = None, 0
    if distributed:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=layout.cp, tp=1, pp=1, ep=layout.ep,
                            etp=1, world_size=layout.world_size)
        model = parallelize_titan_moe(model, dims, job_config(layout))
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
        group = dims.get_mesh("loss").get_group()
        ep_enabled = dims.ep_enabled
        if dims.cp_enabled:
            cp_group = dims.get_mesh("cp").get_group()
        if dims.dp_enabled:
            dp_rank = dims.get_mesh("batch").get_local_rank()
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {
        "lr": LR, "weight_decay": 0.0, "foreach": False, "fused": layout.fused})
    guard = FiniteStepGuard(optimizers, max_consecutive=1) if layout.fused else None
    balancer = QuantileBalancer(model)
    rows = GLOBAL_ROWS * layout.cp // layout.world_size
    loss_fn = ChunkedCrossEntropy(model.output, layout.loss_chunk) if layout.loss_chunk else None
    losses, biases, norms = [], [], []
    for step in range(1, steps + 1):
        tokens, doc_ids = global_batch(model.args.vocab_size, layout.seq_len)
        own = slice(dp_rank * rows, (dp_rank + 1) * rows)
        inputs = {"input": tokens[own, :-1], "doc_ids": doc_ids[own]}
        labels = tokens[own, 1:]
        if cp_group is not None:
            inputs, labels = shard_batch(inputs, labels, cp_group)
        n_tokens = GLOBAL_ROWS * layout.seq_len
        if loss_fn is None:
            logits = model(inputs["input"], inputs["doc_ids"])
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                       reduction="sum")
        else:
            with hidden_from_head(model.output):
                loss_sum = loss_fn(model(inputs["input"], inputs["doc_ids"]), labels)
        (loss_sum / n_tokens).backward()
        if guard is not None:
            guard.begin(step)
            guard.add_loss(loss_sum / n_tokens)
        params = list(model.parameters())
        norm = tt_dist_utils.clip_grad_norm_(params, layout.max_norm, ep_enabled=ep_enabled)
        optimizers.step()
        # torchtitan's norm of the gradients the update used: clipped in place by its clip, or
        # divided by grad_scale inside the fused kernel, which writes them back.
        used = _torchtitan_clip_grad_norm_(params, math.inf, ep_enabled=ep_enabled)
        norms.append((norm.item(), used.item()))
        optimizers.zero_grad()
        all_reduce_qb_stats(balancer.routers, group)
        balancer.step()
        total = loss_sum.detach().clone()
        if distributed:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / n_tokens)
        biases.append([r.expert_bias.clone() for r in balancer.routers])
    if guard is not None:  # the clip_grad_norm_ it stands in for, back for the next layout
        tt_dist_utils.clip_grad_norm_ = _torchtitan_clip_grad_norm_
    return {"losses": losses, "biases": biases, "grad_norms": norms}


def fp32_island_dtypes(layout: Layout) -> dict[str, str]:
    """Parameter dtypes seen in forward, under bf16 FSDP: AttnRes, router and norms vs a Linear."""
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=layout.ep, etp=1,
                        world_size=layout.world_size)
    model = parallelize_titan_moe(build_model(), dims, job_config(layout))
    seen: dict[str, str] = {}
    layer = model.layers["1"]
    watched = {"attn_res.query": (layer.ffn_site, "query"),
               "router.weight": (layer.ffn.router, "weight"),
               "ffn_norm.weight": (layer.ffn_norm, "weight"),
               "w_down.weight": (layer.ffn.w_down, "weight")}
    for name, (module, attr) in watched.items():

        def record(m, args, name=name, attr=attr) -> None:
            seen.setdefault(name, str(getattr(m, attr).dtype))

        module.register_forward_pre_hook(record)
    model(global_batch(128)[0][:1, :-1])
    return seen


def train_layouts(layouts: list[Layout], island_dtypes: bool = False) -> dict:
    """On every rank of the default process group: each layout's `train` results by name, and
    with island_dtypes the `fp32_island_dtypes` of both shardings (2 ranks)."""
    results = {layout.name: train(layout) for layout in layouts}
    if island_dtypes:
        for sharding in ("fsdp2", "simple_fsdp"):
            layout = Layout(2, sharding=sharding, param_dtype="bfloat16")
            results[f"dtypes_{sharding}"] = fp32_island_dtypes(layout)
    return results


def spawn_entry(rank: int, world_size: int, port: int, layouts: list[Layout], out: str,
                island_dtypes: bool = False) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    use_platform("cpu")
    dist.init_process_group("gloo")
    results = train_layouts(layouts, island_dtypes)
    if rank == 0:
        torch.save(results, out)
    end_rank()


def end_rank() -> None:
    """A spawned gloo rank's last call, once its work passed: a barrier (no rank tears gloo down
    while its peer still works), the group destroyed, and the process left without Python's
    interpreter shutdown, as titan_moe.train.trainer.run ends a gloo rank
    (`exit_past_gloo_threads` says why; CPU CI saw these tests' ranks die at that point with
    SIGABRT, `malloc(): unaligned tcache chunk detected`, and SIGSEGV). A failing rank raises
    before this, and spawn reports it."""
    dist.barrier()
    dist.destroy_process_group()
    exit_past_gloo_threads()


def spawn_layouts(world_size: int, layouts: list[Layout], out: str,
                  island_dtypes: bool = False) -> dict:
    """Train `layouts` on `world_size` spawned gloo processes; rank 0's results, saved at `out`.

    A rank killed by a signal is retried once, with a fresh rendezvous: gloo on the CPU CI host
    now and then aborts a rank natively (`malloc(): unaligned tcache chunk detected`, SIGABRT;
    the same file then passes alone). An exception raised in a rank (a failed check, an error)
    is never retried, and a second signal fails the test."""
    args = (world_size, layouts, out, island_dtypes)
    try:
        _spawn(*args)
    except mp.ProcessExitedException as crash:
        if crash.signal_name is None:
            raise
        warnings.warn(f"rank {crash.error_index} died by {crash.signal_name}; retrying once",
                      stacklevel=2)
        _spawn(*args)
    return torch.load(out)


def _spawn(world_size: int, layouts: list[Layout], out: str, island_dtypes: bool) -> None:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawn_entry, args=(world_size, port, layouts, out, island_dtypes), nprocs=world_size,
             join=True)
