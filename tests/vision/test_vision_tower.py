"""The vision tower: 2-D RoPE, placeholder scatter, gradients reaching it (compiled: parity)."""

import dataclasses

import pytest
import torch

from titan_moe.data.multimodal import MultimodalDataset
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.model.vision import (
    VisionTower,
    apply_rope,
    merged_valid,
    rope_2d,
    scatter_image_embeddings,
)


def test_rope_2d_scores_depend_only_on_the_2d_offset():
    # <R(a) q, R(b) k> must equal <R(a + s) q, R(b + s) k> for any shift s of both positions,
    # and change when only one axis of one position moves. fp32, tolerance 1e-4.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 32, generator=g)
    a, b, s = torch.tensor([3, 7]), torch.tensor([11, 2]), torch.tensor([5, -4])

    def score(pa, pb):
        cos_a, sin_a = rope_2d(pa.view(1, 1, 2), 32, 100.0)
        cos_b, sin_b = rope_2d(pb.view(1, 1, 2), 32, 100.0)
        return (apply_rope(q, cos_a, sin_a) * apply_rope(k, cos_b, sin_b)).sum()

    assert torch.allclose(score(a, b), score(a + s, b + s), atol=1e-4)
    assert not torch.allclose(score(a, b), score(a + torch.tensor([1, 0]), b), atol=1e-2)
    assert not torch.allclose(score(a, b), score(a + torch.tensor([0, 1]), b), atol=1e-2)


def test_scatter_places_the_kth_merged_patch_at_the_kth_placeholder():
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([[5, 3, 3, 6, 3, 7], [3, 8, 8, 8, 8, 8]])
    embeds = torch.randn(2, 6, 4, generator=g)
    merged = torch.randn(2, 3, 4, generator=g)
    valid = torch.tensor([[True, True, True], [True, False, False]])
    out = scatter_image_embeddings(embeds, tokens, 3, merged, valid)
    expected = embeds.clone()  # the reference: a plain loop over positions
    for b in range(2):
        k = 0
        for t in range(6):
            if tokens[b, t] == 3:
                expected[b, t] = merged[b, k]
                k += 1
    assert torch.equal(out, expected)


def test_placeholder_count_must_equal_merged_patch_count():
    tokens = torch.tensor([[5, 3, 3, 6]])
    merged = torch.zeros(1, 4, 2)
    valid = torch.tensor([[True, True, True, False]])
    with pytest.raises(ValueError, match="row 0 .* 2 image placeholder tokens .* 3 merged"):
        scatter_image_embeddings(torch.zeros(1, 4, 2), tokens, 3, merged, valid)


def _tower_inputs(vision, g):
    p = vision.window_patches
    patches = torch.randn(2, p, 3 * 14 * 14, generator=g)
    pos = torch.randint(0, 6, (2, p, 2), generator=g)
    image = torch.full((2, p), -1)
    image[0, :16], image[0, 16:40], image[1, :8] = 0, 1, 0
    return patches, pos, image


def test_images_attend_only_within_themselves(vision):
    # Changing image 1's pixels must leave image 0's merged outputs exactly unchanged.
    torch.manual_seed(0)
    tower = VisionTower(vision, out_dim=16)
    tower.init_weights(0.02)
    patches, pos, image = _tower_inputs(vision, torch.Generator().manual_seed(2))
    other = patches.clone()
    other[0, 16:40] += 1.0
    a, b = tower(patches, pos, image), tower(other, pos, image)
    torch.testing.assert_close(a[0, :4], b[0, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(a[0, 4:10], b[0, 4:10], atol=1e-3)


def test_gradients_reach_every_vision_parameter(vision, tokenizer, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "def f(x):\\n    return x + 1\\n"}\n')
    from titan_moe.data.images import digits

    documents = [[image, f"a handwritten digit {label}"] for image, label in digits("val")[:4]]
    dataset = MultimodalDataset([text], documents, tokenizer, seq_len=64, vision=vision)
    batch = [item for item, _ in zip(dataset, range(2), strict=False)]
    inputs = {k: torch.stack([x[k] for x, _ in batch]) for k in batch[0][0]}
    labels = torch.stack([y for _, y in batch])
    assert (inputs["patch_image"] >= 0).any()

    args = dataclasses.replace(get_flavor("debug"), n_layers=2, mla_layers=(2,), vision="debug",
                               max_seq_len=64).validate()
    torch.manual_seed(0)
    model = TitanMoE(args)
    model.init_weights()
    logits = model(inputs["input"], inputs["doc_ids"], inputs["patches"], inputs["patch_pos"],
                   inputs["patch_image"])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    for name, p in model.vision.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches vision.{name}"
    assert merged_valid(inputs["patch_image"], 4).sum() == (inputs["input"] == 3).sum()
