"""The titan_moe TrainSpec as "titan_moe_rows": a global batch that every layout sees whole, and
each rank's QB biases written after every optimizer step.

The corpus dataloader gives data rank r of D its own documents, so a run on D data ranks trains
on other text than one process. Here row i of global step s is drawn from seed (s, i): a random
start token counting up by a random stride (mod vocab), with a second document from position
SECOND_DOC on (doc_ids 0 then 1), so the pipeline carries doc_ids and the mixers reset. Data
rank r with local batch b reads global rows r*b .. r*b+b-1. After each optimizer step (and its
Quantile Balancing) every rank appends {layer id: expert_bias} of the routers it holds to
$QB_BIAS_FOLDER/rank<r>.pt.
Loaded with `--experimental.custom_import tests.distributed.pipeline_spec --model.name
titan_moe_rows`.
"""

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from titan_moe.model.router import Router
from titan_moe.train.config import job_model_args
from titan_moe.train.optimizer import build_optimizers_with_quantile_balancing
from titan_moe.train.trainer import titan_moe_train_spec

SPEC_NAME = "titan_moe_rows"
SECOND_DOC = 40


class CountingRows(IterableDataset):
    """Rows first_row .. first_row + rows - 1 of each global step; resumable (its state is
    the step)."""

    def __init__(self, seq_len: int, vocab_size: int, first_row: int, rows: int) -> None:
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.first_row, self.rows = first_row, rows
        self.step = 0

    def __iter__(self):
        while True:
            rows = [self.row(r) for r in range(self.first_row, self.first_row + self.rows)]
            # Counted before the rows are handed out: a checkpoint taken after this step's batch
            # resumes with the next.
            self.step += 1
            yield from rows

    def row(self, row: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(self.step * 100_003 + row)
        start, stride = torch.randint(self.vocab_size, (2,), generator=g).tolist()
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        doc_ids = (torch.arange(self.seq_len) >= SECOND_DOC).int()
        return {"input": tokens[:-1], "doc_ids": doc_ids}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def build_rows_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    batch = job_config.training.local_batch_size
    vocab = job_model_args(job_config).vocab_size
    dataset = CountingRows(job_config.training.seq_len, vocab, dp_rank * batch, batch)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=batch)


class BiasRecorder:
    """Optimizer post-step hook: append this rank's router biases to its file."""

    def __init__(self, model_parts, path: Path) -> None:
        self.routers = [m for part in model_parts for m in part.modules()
                        if isinstance(m, Router)]
        self.path = path
        self.steps: list[dict[int, torch.Tensor]] = []

    def __call__(self, *_args, **_kwargs) -> None:
        self.steps.append({r.layer_id: r.expert_bias.detach().clone() for r in self.routers})
        torch.save(self.steps, self.path)


def build_recording_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    optimizers = build_optimizers_with_quantile_balancing(model_parts, optimizer_config,
                                                          parallel_dims, ft_manager)
    folder = Path(os.environ["QB_BIAS_FOLDER"])
    folder.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    optimizers.register_step_post_hook(BiasRecorder(model_parts, folder / f"rank{rank}.pt"))
    return optimizers


try:
    get_train_spec(SPEC_NAME)
except ValueError:
    register_train_spec(SPEC_NAME, dataclasses.replace(
        titan_moe_train_spec(), build_dataloader_fn=build_rows_dataloader,
        build_optimizers_fn=build_recording_optimizers))
