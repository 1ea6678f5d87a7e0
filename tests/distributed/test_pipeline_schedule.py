"""Two gloo processes run torch.distributed.pipelining's Schedule1F1B over our StageModules (cut
on an AttnRes block boundary): each micro-batch's loss and every parameter's gradient equal one
process running the whole model on the same micro-batches, float32, bit for bit. This checks
the stages' input/output protocol against torch's pipelining, which the trainer builds on
(parallel/pipeline_schedule.py; the trainer under pp: test_pipeline_trainer.py). The trainer's
RoutedPipelineStage, with the vision tower on the first stage, leaves the routers' Quantile
Balancing counts one process's: torch's first-step shape inference counts nothing."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from tests.distributed.harness import end_rank, tiny_args
from tests.distributed.test_pipeline_stages import multimodal_batch
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.pipeline import model_stages, split_into_stages, stage_inputs
from titan_moe.parallel.pipeline_schedule import RoutedPipelineStage

MICROBATCHES, ROWS, SEQ = 2, 4, 32


def _model() -> TitanMoE:
    torch.manual_seed(0)
    model = TitanMoE(tiny_args())
    model.init_weights()
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (ROWS, SEQ + 1), generator=gen)
    doc_ids = torch.cat([torch.zeros(ROWS, 12), torch.ones(ROWS, SEQ - 12)], 1).int()
    return tokens[:, :-1], doc_ids, tokens[:, 1:]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    tokens, doc_ids, labels = _batch()
    losses = []
    for part in zip(*(x.chunk(MICROBATCHES) for x in (tokens, doc_ids, labels)), strict=True):
        loss = _loss(model(part[0], part[1]), part[2])
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    want_losses, want_grads = _reference()
    model = _model()
    stages = model_stages(model, 2)
    assert stages[1].start % model.args.attn_res_block_size == 0  # cut on a block boundary
    stage = PipelineStage(split_into_stages(model, stages)[rank], rank, 2, torch.device("cpu"))
    # scale_grads=False: the loss is a sum, as the trainer's; by default torch divides every
    # gradient by the number of micro-batches.
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_loss,
                            scale_grads=False)
    tokens, doc_ids, labels = _batch()
    losses: list[torch.Tensor] = []
    # Both ranks pass the doc_ids by keyword: the schedule hands each stage its micro-batch's.
    if rank == 0:
        schedule.step(tokens, doc_ids=doc_ids)
    else:
        schedule.step(doc_ids=doc_ids, target=labels, losses=losses)
        assert [loss.item() for loss in losses] == want_losses
    held = dict(split_into_stages(model, stages)[rank].named_parameters())
    assert held, "a stage without parameters"
    for name, param in held.items():
        assert torch.equal(param.grad, want_grads[name]), name
    end_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_stage_1f1b_equals_one_process():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)


def _routed_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    batch = multimodal_batch(_vision_model(), rows=ROWS, seq_len=SEQ)
    labels = batch["input"].roll(-1, 1)
    reference = _vision_model()
    for mb in range(MICROBATCHES):
        part = {k: v.chunk(MICROBATCHES)[mb] for k, v in batch.items()}
        _loss(reference(part.pop("input"), **part), labels.chunk(MICROBATCHES)[mb]).backward()
    want = dict(reference.named_buffers())

    model = _vision_model()
    stages = model_stages(model, 2)
    part = split_into_stages(model, stages)[rank]
    stage = RoutedPipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_loss,
                            scale_grads=False)
    tokens, first_stage, every_stage = stage_inputs(batch)
    if rank == 0:
        schedule.step(tokens, **first_stage, **every_stage)
    else:
        schedule.step(**every_stage, target=labels)
    stats = {n: b for n, b in part.named_buffers() if n.endswith(("qb_hist", "expert_load"))}
    assert stats, "a stage without routers"
    for name, counts in stats.items():
        assert torch.equal(counts, want[name]), name
    if rank == 0:
        tower = [p.grad for n, p in part.named_parameters() if n.startswith("vision.")]
        assert tower and all(g is not None and g.abs().sum() > 0 for g in tower)
    end_rank()


def _vision_model() -> TitanMoE:
    torch.manual_seed(0)
    model = TitanMoE(dataclasses.replace(get_flavor("debug"), vision="debug"))
    model.init_weights()
    return model


@pytest.mark.slow
def test_routed_stages_count_only_the_micro_batches_with_the_tower_on_the_first_stage():
    """RoutedPipelineStage under Schedule1F1B with the vision tower on the first stage and a
    multimodal batch (the image inputs by keyword, as the trainer passes them): the step runs
    (torch 2.11's shape inference hands the first stage zero tokens, with no image
    placeholder), the tower gets gradients, and every router's Quantile Balancing histogram and
    load are one process's over the same micro-batches, exact counts: the shape inference's
    extra forward of each stage is not counted."""
    mp.spawn(_routed_worker, args=(_free_port(),), nprocs=2, join=True)
