"""Pipeline stages (titan_moe/parallel/pipeline.py), in one process: what crosses a cut against
the model's own forward, the cuts against brute force, and the stages chained against the
whole model (outputs and every parameter's gradient, float32, bit for bit: the stages run the
model's own modules in the model's order), with and without the vision tower on the first
stage. Every stage takes the doc_ids by keyword, as torch's schedules hand a rank's keyword
inputs to each of its stages; only floating-point hidden states cross a cut."""

import dataclasses
import itertools

import pytest
import torch

from titan_moe.data.images import image_patches
from titan_moe.data.multimodal import MultimodalPacker, batch_item
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.pipeline import (
    StageModule,
    balanced_stages,
    boundary_bytes,
    boundary_tensors,
    model_stages,
    split_into_stages,
)


def _model(**overrides) -> TitanMoE:
    torch.manual_seed(0)
    model = TitanMoE(dataclasses.replace(get_flavor("debug"), **overrides))
    model.init_weights()
    return model


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_boundary_tensors_are_what_the_model_carries_into_each_layer(block_size):
    """The model's own forward, layer by layer: len(blocks) + the partial sum entering layer i."""
    model = _model(attn_res_block_size=block_size)
    tokens = torch.randint(0, model.args.vocab_size, (1, 8))
    blocks, partial = [], model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        assert boundary_tensors(block_size, i) == len(blocks) + 1, i
        blocks, partial = layer(blocks, partial, None)


def _brute_force(weights, first, last, pp, allowed):
    """The smallest largest stage over every choice of pp - 1 cuts among `allowed`."""
    n, best = len(weights), None
    for cuts in itertools.combinations(allowed, pp - 1):
        edges = [0, *cuts, n]
        stages = [sum(weights[a:b]) + (first if a == 0 else 0) + (last if b == n else 0)
                  for a, b in itertools.pairwise(edges)]
        best = max(stages) if best is None else min(best, max(stages))
    return best


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_stages_are_balanced_and_cut_on_blocks_while_there_are_enough(pp):
    weights, first, last = [5, 9, 2, 7, 7, 3, 8, 1], 6, 4  # 8 layers in 4 blocks of 2
    stages = balanced_stages(weights, 2, pp, first, last)
    assert len(stages) == pp and stages[0].start == 0 and stages[-1].stop == 8
    assert all(a.stop == b.start and len(a) > 0 for a, b in itertools.pairwise(stages))
    allowed = [2, 4, 6] if pp <= 4 else list(range(1, 8))
    assert {s.start for s in stages[1:]} <= set(allowed)
    largest = max(sum(weights[s.start:s.stop]) + (first if s.start == 0 else 0)
                  + (last if s.stop == 8 else 0) for s in stages)
    assert largest == _brute_force(weights, first, last, pp, allowed)
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree = 9: must be in \[1, "):
        balanced_stages(weights, 2, 9)


def _gradients(model: torch.nn.Module, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of mean(out²), then cleared from the model."""
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_equal_to_the_model(model, stages, got, want, want_grads) -> None:
    """The last stage's output and every gradient equal the whole model's bit for bit, and the
    stages' parameter names are the model's (the checkpoint's keys: layers.<i>. ...)."""
    assert torch.equal(got, want)
    grads = _gradients(model, got)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("pp", [2, 3, 8])
def test_stages_chained_equal_the_model_outputs_and_gradients(pp):
    """What crosses each cut is the boundary's hidden states, all floating point: torch 2.11's
    PipelineStage makes every received tensor require grad, which an integer one cannot. The
    doc_ids reach every stage by keyword; the model's output depends on them, so a stage that
    dropped them would not equal it."""
    model = _model()  # 8 layers (6 KDA, 2 MLA) in AttnRes blocks of 2, MoE from layer 1
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    doc_ids = torch.cat([torch.zeros(2, 12), torch.ones(2, 20)], 1).int()
    with torch.no_grad():
        assert not torch.equal(model(tokens), model(tokens, doc_ids))
    want = model(tokens, doc_ids)
    want_grads = _gradients(model, want)

    stages = split_into_stages(model, model_stages(model, pp))
    assert len(stages) == pp
    carried = (tokens,)
    for stage in stages[:-1]:
        carried = stage(*carried, doc_ids=doc_ids)
        assert len(carried) == boundary_tensors(2, stage_end(stage))
        assert all(t.is_floating_point() for t in carried)
    got = stages[-1](*carried, doc_ids=doc_ids)
    _assert_equal_to_the_model(model, stages, got, want, want_grads)


def stage_end(stage: StageModule) -> int:
    return max(int(i) for i in stage.layers) + 1


def test_bad_stages_are_one_error():
    model = _model()
    with pytest.raises(ValueError, match="must cover layers 0..7 in order"):
        split_into_stages(model, [range(0, 3), range(4, 8)])
    text_only = StageModule(model, range(0, 4))
    tokens = torch.randint(0, model.args.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="the batch has image patches but titan_moe.vision"):
        text_only(tokens, patches=torch.zeros(1, 4, 588), patch_pos=torch.zeros(1, 4, 2).long(),
                  patch_image=torch.zeros(1, 4).long())


def test_boundary_bytes_are_what_a_cut_sends():
    """A cut inside block 1 (before layer 3, blocks of 2) of the debug model (d 256), micro-batch
    of 2 rows x 32 tokens, fp32. By hand: the embedding, block 0's sum and block 1's partial sum,
    3 x 2 x 32 x 256 x 4 B = 196608 B (the doc_ids do not cross)."""
    model = _model()
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    doc_ids = torch.zeros(2, 32, dtype=torch.int32)
    first, _ = split_into_stages(model, [range(0, 3), range(3, 8)])
    sent = first(tokens, doc_ids=doc_ids)
    size = boundary_bytes(2, 3, 2, 32, 256, torch.float32)
    assert size == 196608
    assert size == sum(t.numel() * t.element_size() for t in sent)
    assert boundary_bytes(2, 3, 2, 32, 256, torch.bfloat16) == 196608 // 2


def test_stage_init_weights_is_the_models_init_of_its_modules():
    """torchtitan materialises each stage (to_empty) and calls its init_weights. Every tensor is
    set, QB state cleared; the first stage draws in the model's own order (embedding, then its
    layers), so from the same seed it equals the whole model's init."""
    args = _model().args
    with torch.device("meta"):
        meta = TitanMoE(args)
    stages = split_into_stages(meta, [range(0, 3), range(3, 8)])
    for stage in stages:
        stage.to_empty(device="cpu")
    torch.manual_seed(5)
    stages[0].init_weights()
    stages[1].init_weights()
    with torch.device("meta"):
        model = TitanMoE(args)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.init_weights()
    want = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, tensor in itertools.chain(stages[0].named_parameters(), stages[0].named_buffers()):
        assert torch.equal(tensor, want[name]), name
    for name, tensor in itertools.chain(stages[1].named_parameters(), stages[1].named_buffers()):
        assert torch.isfinite(tensor).all(), name
        if name.endswith(("expert_bias", "qb_hist", "expert_load", "norm.weight")):
            assert torch.equal(tensor, want[name]), name


IMAGE_START, IMAGE_END = 4, 5  # any ids but the placeholder (image_token_id 3) and padding (0)


def multimodal_batch(model: TitanMoE, rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """`rows` windows packed as the training data packs them (data/multimodal.py), each of
    documents text, image, text: images of random size and pixels, text of random ids."""
    vision, image_id = model.vision.args, model.args.image_token_id
    g = torch.Generator().manual_seed(1)
    packer, windows = MultimodalPacker(seq_len, vision, pad_id=0), []
    while len(windows) < rows:
        height, width = (int(x) for x in torch.randint(20, 60, (2,), generator=g))
        patches, pos = image_patches(torch.rand(3, height, width, generator=g), vision)
        placeholders = [image_id] * (len(patches) // vision.merge**2)
        text = [torch.randint(10, model.args.vocab_size, (int(n),), generator=g).tolist()
                for n in torch.randint(3, 12, (2,), generator=g)]
        windows += packer.add([text[0], ([IMAGE_START, *placeholders, IMAGE_END], patches, pos),
                               text[1]])
    items = [batch_item(w, image_id)[0] for w in windows[:rows]]
    return {k: torch.stack([x[k] for x in items]) for k in items[0]}


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_chained_with_the_vision_tower_equal_the_model(pp):
    """The tower on the first stage, its image inputs by keyword (as the trainer passes a batch's
    extra inputs); later stages are handed them too (torch's multi-stage schedules give a rank's
    keyword inputs to each of its stages) and ignore them. Outputs and every gradient, the
    tower's included, equal the whole model's bit for bit (float32)."""
    model = _model(vision="debug")
    batch = multimodal_batch(model, rows=2, seq_len=32)
    assert all((batch["patch_image"][r] >= 0).any() for r in range(2)), "every row has an image"
    images = {k: batch[k] for k in ("patches", "patch_pos", "patch_image")}
    want = model(batch["input"], batch["doc_ids"], **images)
    want_grads = _gradients(model, want)
    tower = [f"vision.{n}" for n, _ in model.vision.named_parameters()]
    assert all(want_grads[n].abs().sum() > 0 for n in tower), (
        "every tower parameter has a gradient, so the comparison covers the tower")

    stages = split_into_stages(model, model_stages(model, pp))
    assert stages[0].vision is model.vision
    assert all(s.vision is None for s in stages[1:])
    carried = stages[0](batch["input"], doc_ids=batch["doc_ids"], **images)
    for stage in stages[1:-1]:
        carried = stage(*carried, doc_ids=batch["doc_ids"], **images)
    got = stages[-1](*carried, doc_ids=batch["doc_ids"], **images)
    _assert_equal_to_the_model(model, stages, got, want, want_grads)
    assert {n for n, _ in stages[0].named_parameters() if n.startswith("vision.")} == set(tower)


def test_stage_init_weights_initialises_the_vision_tower_as_the_model_does():
    """One stage of the whole model draws in the model's order, so from one seed it equals the
    model's init, the tower's included; the first of two stages sets every tower tensor with the
    tower's init (zero biases, unit norm weights, finite weights)."""
    args = _model(vision="debug").args

    def materialised(stages):
        with torch.device("meta"):
            meta = TitanMoE(args)
        parts = split_into_stages(meta, stages)
        for part in parts:
            part.to_empty(device="cpu")
        torch.manual_seed(5)
        for part in parts:
            part.init_weights()
        return parts

    with torch.device("meta"):
        model = TitanMoE(args)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.init_weights()
    want = dict(model.named_parameters()) | dict(model.named_buffers())
    (whole,) = materialised([range(0, 8)])
    for name, tensor in itertools.chain(whole.named_parameters(), whole.named_buffers()):
        assert torch.equal(tensor, want[name]), name
    first, _ = materialised([range(0, 3), range(3, 8)])
    for name, tensor in first.vision.named_parameters():
        assert torch.isfinite(tensor).all(), name
        if name.endswith("bias"):
            assert not tensor.any(), name
        elif tensor.dim() == 1:  # LayerNorm / RMSNorm weights
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert 0 < tensor.std() < 3 * args.init_std, name
