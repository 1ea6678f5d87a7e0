"""Pipeline stages of a TitanMoE, cut on Block AttnRes boundaries.

What crosses a cut. Entering decoder layer i the model holds `blocks` (the embedding, then every
finished block's sum: ceil(i / S) tensors, S = attn_res_block_size) and `partial` (the current
block's sum so far; at a block's first layer, the block just finished), each [b, T, d]
(model/model.py). A stage before layer i therefore sends ceil(i / S) + 1 tensors forward (and
their gradients back): at a block boundary, the finished blocks; inside a block, one more, the
unfinished block's partial sum. Every hidden state of the layers before the cut stays behind,
which is why blocks make good pipeline units.

`balanced_stages` places the cuts; `StageModule` runs one stage's share of the model's forward,
its modules shared with the model (so parameter names, the checkpoint's keys, are the model's:
`layers.<i>....`). Stage inputs and outputs are flat tuples of tensors, as
`torch.distributed.pipelining` passes them between ranks: the first stage takes the tokens, every
later one (*blocks, partial); a stage before the last returns (*blocks, partial), the last the
logits. Every layer's mixer reads the doc_ids, which every stage takes by keyword: torch's
schedules cut the keyword inputs of `step` / `eval` into micro-batches and hand them to each
stage a rank runs, so the trainer and validator pass them on every pipeline rank. They do not
cross a cut: torch 2.11's PipelineStage makes every received tensor require grad, which an
integer one cannot.

The vision tower sits on the first stage: its output only replaces the `<|image|>` placeholders'
embeddings, so the stage takes a multimodal batch's patches, patch_pos and patch_image by keyword
(as the trainer passes them) and nothing about images crosses a cut.
`boundary_bytes` is what one micro-batch sends across a cut.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from titan_moe.model.model import (
    TitanMoE,
    embed_inputs,
    init_embedding_weights,
    init_head_weights,
)

# The keyword inputs every stage takes (its layers read them); a batch's others (the image
# inputs) only enter the first stage.
EVERY_STAGE_INPUTS = ("doc_ids",)


def stage_inputs(batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A batch ({"input": tokens, "doc_ids": ..., image inputs}) as the schedule takes it:
    (tokens, the first stage's keyword inputs, every stage's keyword inputs)."""
    every_stage = {k: v for k, v in batch.items() if k in EVERY_STAGE_INPUTS}
    first_stage = {k: v for k, v in batch.items() if k != "input" and k not in every_stage}
    return batch["input"], first_stage, every_stage


def boundary_tensors(block_size: int, layer: int) -> int:
    """[b, T, d] tensors entering decoder layer `layer` (0-based) from the layers before it."""
    return math.ceil(layer / block_size) + 1


def boundary_bytes(block_size: int, layer: int, microbatch: int, seq_len: int, dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes one micro-batch sends forward across a cut before decoder layer `layer`: its
    `boundary_tensors` [microbatch, seq_len, dim] hidden states in `dtype`. Their gradients
    come back, the same size again."""
    return boundary_tensors(block_size, layer) * microbatch * seq_len * dim * dtype.itemsize


def balanced_stages(weights: Sequence[int], block_size: int, pp: int, first_extra: int = 0,
                    last_extra: int = 0) -> list[range]:
    """pp contiguous stages of the layers (per-layer `weights`, plus the extras the first and
    last stage hold) whose largest stage is smallest, cut only on block boundaries when there
    are at least pp blocks, between any two layers otherwise."""
    n = len(weights)
    if not 1 <= pp <= n:
        raise ValueError(f"pipeline_parallel_degree = {pp}: must be in [1, n_layers = {n}]")
    cuts = [i for i in range(1, n) if i % block_size == 0]
    if len(cuts) + 1 < pp:
        cuts = list(range(1, n))
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(a: int, b: int) -> int:
        return (prefix[b] - prefix[a] + (first_extra if a == 0 else 0)
                + (last_extra if b == n else 0))

    points = [0, *cuts, n]
    # best[k][j]: the smallest largest stage covering layers 0 .. points[j] - 1 in k stages.
    best = [[math.inf] * len(points) for _ in range(pp + 1)]
    back = [[0] * len(points) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for j in range(1, len(points)):
            for i in range(j):
                value = max(best[k - 1][i], cost(points[i], points[j]))
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    stages, j = [], len(points) - 1
    for k in range(pp, 0, -1):
        i = back[k][j]
        stages.append(range(points[i], points[j]))
        j = i
    return stages[::-1]


def model_stages(model: TitanMoE, pp: int) -> list[range]:
    """`balanced_stages` by parameter count: the embedding (and vision tower) weigh on the first
    stage, the final site, norm and head on the last."""
    def count(*modules: nn.Module | None) -> int:
        return sum(p.numel() for m in modules if m is not None for p in m.parameters())

    weights = [count(layer) for layer in model.layers.values()]
    first = count(model.tok_embeddings, model.vision)
    last = count(model.final_site, model.norm, model.output)
    return balanced_stages(weights, model.args.attn_res_block_size, pp, first, last)


class StageModule(nn.Module):
    """Layers `layers` of `model` (with the embedding and the vision tower, if any, on the first
    stage and the final AttnRes site, norm and head on the last) as one pipeline stage."""

    def __init__(self, model: TitanMoE, layers: range) -> None:
        super().__init__()
        n = model.args.n_layers
        if not 0 <= layers.start < layers.stop <= n:
            raise ValueError(f"stage layers {layers}: must be a non-empty part of 0..{n - 1}")
        self.first, self.last = layers.start == 0, layers.stop == n
        # parallelize_titan_moe reads a model's args, and its vision tower (None on later stages)
        # to compile and shard it.
        self.args = model.args
        self.vision = model.vision if self.first else None
        self.tok_embeddings = model.tok_embeddings if self.first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.final_site = model.final_site if self.last else None
        self.norm = model.norm if self.last else None
        self.output = model.output if self.last else None

    def forward(self, *inputs: torch.Tensor, doc_ids: torch.Tensor | None = None,
                patches: torch.Tensor | None = None, patch_pos: torch.Tensor | None = None,
                patch_image: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.first:
            (tokens,) = inputs
            blocks = []
            partial = embed_inputs(self.tok_embeddings, self.vision, self.args.image_token_id,
                                   tokens, patches, patch_pos, patch_image)
        else:
            # A later stage ignores the image inputs: torch's multi-stage schedules hand a rank's
            # keyword inputs to every stage it runs, and the images entered at the first stage.
            *blocks, partial = inputs
        for layer in self.layers.values():
            blocks, partial = layer(blocks, partial, doc_ids)
        if self.last:
            return self.output(self.norm(self.final_site(blocks + [partial])))
        return (*blocks, partial)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """The model's init of the modules this stage holds (torchtitan calls it per part after
        `to_empty`). Each pipeline rank draws from its own seed, so the values differ from one
        process's; a seed checkpoint (`checkpoint.create_seed_checkpoint`) gives every layout
        the same weights."""
        if self.tok_embeddings is not None:
            init_embedding_weights(self.tok_embeddings)
        for layer in self.layers.values():
            layer.init_weights()
        if self.last:
            self.final_site.init_weights()
            self.norm.reset_parameters()
        # After the last stage's final site and norm, as TitanMoE.init_weights draws: a model of
        # one stage is then initialised exactly as the model.
        if self.vision is not None:
            self.vision.init_weights(self.args.init_std)
        if self.last:
            init_head_weights(self.output)


def split_into_stages(model: TitanMoE, stages: Sequence[range]) -> list[StageModule]:
    """One StageModule per range (contiguous, covering every layer once)."""
    n = model.args.n_layers
    joined = all(a.stop == b.start for a, b in zip(stages, stages[1:], strict=False))
    if not (stages and joined and stages[0].start == 0 and stages[-1].stop == n
            and all(len(s) > 0 for s in stages)):
        raise ValueError(f"stages {list(stages)} must cover layers 0..{n - 1} in order, each "
                         "non-empty")
    return [StageModule(model, s) for s in stages]
