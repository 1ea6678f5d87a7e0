"""A tiny stand-in TrainSpec, "titan_moe_smoke", for exercising the trainer plumbing fast.

torchtitan's llama3 model at toy size, parallelized by torchtitan's own parallelize_llama
(FSDP2, activation checkpointing), fed a synthetic learnable stream: row i of global step s is
the arithmetic sequence a, a+d, a+2d, ... (mod vocab) with (a, d) drawn from seed (s, i). Data
rank r with local batch b reads global rows r*b .. r*b+b-1, so any process count sees the same
global batch. A fake balancer stands in for QuantileBalancer so the moe/* plumbing is exercised.
Loaded with `--experimental.custom_import tests.train.smoke_spec --model.name titan_moe_smoke`.
"""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from titan_moe.train.optimizer import attach_load_balancing
from titan_moe.train.trainer import build_metrics_processor

SPEC_NAME = "titan_moe_smoke"
N_FAKE_EXPERTS = 8


class SmokeTransformer(Transformer):
    """llama3 whose matrices are drawn from one seeded stream of *full* tensors, so every
    process count starts from the same weights (DTensor's own RNG on CPU does not)."""

    def init_weights(self, buffer_device=None) -> None:
        super().init_weights(buffer_device=buffer_device)
        g = torch.Generator().manual_seed(0)
        for param in self.parameters():
            if param.ndim < 2:
                continue
            full = torch.randn(param.shape, generator=g) * 0.02
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements)
            param.copy_(full)


class ArithmeticSequences(IterableDataset):
    def __init__(self, seq_len: int, vocab_size: int, first_row: int, rows: int) -> None:
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.first_row, self.rows = first_row, rows

    def __iter__(self):
        step = 0
        while True:
            for row in range(self.first_row, self.first_row + self.rows):
                g = torch.Generator().manual_seed(step * 100_003 + row)
                start, stride = torch.randint(self.vocab_size, (2,), generator=g).tolist()
                tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
                yield {"input": tokens[:-1]}, tokens[1:]
            step += 1


def build_smoke_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    batch = job_config.training.local_batch_size
    dataset = ArithmeticSequences(
        job_config.training.seq_len, SMOKE_FLAVORS["tiny"].vocab_size, dp_rank * batch, batch
    )
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch
    )


class FakeBalancer:
    """Reports what QuantileBalancer reports, from a deterministic fake expert load."""

    routers: list = []

    def __init__(self) -> None:
        self.steps = 0
        self.expert_load = None

    def step(self, skip: torch.Tensor | None = None) -> None:
        self.steps += 1
        self.expert_load = torch.arange(1.0, N_FAKE_EXPERTS + 1).unsqueeze(0)

    def metrics(self) -> dict[str, float]:
        return {"moe/max_violation": 1.0 / self.steps} if self.steps else {}

    def discard(self) -> None:
        """Nothing accumulates between steps."""


def build_smoke_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    attach_load_balancing(optimizers, [FakeBalancer()])
    return optimizers


SMOKE_FLAVORS = {
    "tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, rope_theta=10000),
}


def smoke_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=SmokeTransformer,
        model_args=SMOKE_FLAVORS,
        parallelize_fn=parallelize_llama,
        pipelining_fn=None,
        build_optimizers_fn=build_smoke_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_smoke_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss,
        build_metrics_processor_fn=build_metrics_processor,
    )


try:
    get_train_spec(SPEC_NAME)
except ValueError:
    register_train_spec(SPEC_NAME, smoke_train_spec())
