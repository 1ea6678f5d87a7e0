"""Image data: dynamic resolution, patch order, packing with patch slots, bad images skipped."""

import json
import logging
import math

import pytest
import torch

from titan_moe.data.images import (
    DIGITS_HELD_OUT,
    digits,
    image_documents,
    image_patches,
    patch_grid,
)
from titan_moe.data.multimodal import MultimodalDataset, MultimodalPacker, encode_document

from .conftest import write_png

IMAGE_ID, START_ID, END_ID = 3, 4, 5


@pytest.mark.parametrize("max_patches", [4, 64, 100, 1024])
def test_dynamic_resolution_respects_the_patch_budget(vision, max_patches):
    vision.max_patches = max_patches - max_patches % 4
    vision.window_patches = max(vision.window_patches, vision.max_patches)
    g = torch.Generator().manual_seed(0)
    for h, w in torch.randint(1, 3000, (300, 2), generator=g).tolist() + [(1, 2999), (28, 28)]:
        rows, cols = patch_grid(h, w, vision)
        assert rows * cols <= vision.max_patches, (h, w, rows, cols)
        assert rows % 2 == 0 and cols % 2 == 0 and rows >= 2 and cols >= 2
        native = (2 * math.ceil(h / 28), 2 * math.ceil(w / 28))
        if native[0] * native[1] <= vision.max_patches:
            assert (rows, cols) == native  # under the budget the image keeps its own size
        else:
            assert rows <= native[0] and cols <= native[1]
            # scaled down, aspect kept to within one 2×2 unit per side
            assert abs(rows / cols - native[0] / native[1]) <= 2 / min(rows, cols) * (
                native[0] / native[1]) + 1e-9 or min(rows, cols) == 2


def test_patches_are_in_merge_order_with_their_positions(vision):
    image = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(0))
    patches, pos = image_patches(image, vision)
    assert patches.shape == (4 * 6, 3 * 14 * 14)
    scaled = image * 2 - 1  # 56×84 is already a whole 4×6 grid: no resampling
    for i, (r, c) in enumerate(pos.tolist()):
        reference = scaled[:, 14 * r : 14 * r + 14, 14 * c : 14 * c + 14].reshape(-1)
        torch.testing.assert_close(patches[i], reference, atol=1e-5, rtol=0)
    for g in range(0, len(pos), 4):  # each run of 4 is one 2×2 group
        rows, cols = pos[g : g + 4, 0], pos[g : g + 4, 1]
        assert rows.max() - rows.min() == 1 and cols.max() - cols.min() == 1
        assert rows.min() % 2 == 0 and cols.min() % 2 == 0


def test_packer_keeps_images_whole_and_placeholders_equal_to_merged_patches(vision, tokenizer):
    seq_len = 40
    packer = MultimodalPacker(seq_len, vision, tokenizer.pad_id)
    g = torch.Generator().manual_seed(0)
    windows = []
    for d in range(12):
        h, w = torch.randint(20, 200, (2,), generator=g).tolist()
        doc = ["caption " * (d % 3), torch.rand(3, h, w, generator=g), "after"]
        windows += list(packer.add(encode_document(doc, tokenizer, vision)))
    windows.append(packer.pop())
    n_images = 0
    for tokens, _, _, _, _, image in windows:
        inputs = tokens[:seq_len]
        n_placeholders = int((inputs == IMAGE_ID).sum())
        assert n_placeholders * 4 == int((image >= 0).sum())
        assert int((tokens[seq_len:] == IMAGE_ID).sum()) == 0  # never on the label-only slot
        assert int((inputs == START_ID).sum()) == int((inputs == END_ID).sum())
        starts, ends = (inputs == START_ID).nonzero()[:, 0], (inputs == END_ID).nonzero()[:, 0]
        for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            assert e - s - 1 == int((image == i).sum()) // 4  # this image's own patches
        assert (image[: int((image >= 0).sum())] >= 0).all()  # images first, then empty slots
        n_images += len(starts)
    assert n_images == 12


def _user_folder(tmp_path):
    write_png(tmp_path / "good.png", 30, 40)
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    lines = [{"image": "good.png", "text": "a noisy square"},
             {"image": "missing.png", "text": "nothing"},
             {"content": [{"text": "before"}, {"image": "corrupt.png"}, {"text": "after"}]}]
    (tmp_path / "images.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    text = tmp_path / "text" / "corpus.jsonl"
    text.parent.mkdir()
    text.write_text('{"text": "plain text between the images"}\n')
    return text


def test_missing_and_corrupt_images_are_skipped_and_counted(vision, tokenizer, tmp_path, caplog):
    text = _user_folder(tmp_path)
    documents = image_documents(str(tmp_path / "images.jsonl"), "train")
    assert len(documents) == 3 and len(documents[2]) == 3  # the interleaved one has 3 pieces
    dataset = MultimodalDataset([text], documents, tokenizer, seq_len=64, vision=vision)
    with caplog.at_level(logging.WARNING):
        items = [x for x, _ in zip(dataset, range(6), strict=False)]
    stats = dataset.stats()
    assert stats["data/images_read"] >= 6 and stats["data/images_skipped"] >= 4
    assert stats["data/images_skipped"] == 2 * (stats["data/images_read"] // 3) + (
        stats["data/images_read"] % 3 == 2)
    assert "missing.png" in caplog.text and "corrupt.png" in caplog.text
    good = image_patches(torch.rand(3, 30, 40), vision)[0].shape[0]
    for inputs, _ in items:  # only the good image ever reaches a window
        n = int((inputs["patch_image"] >= 0).sum())
        assert n % good == 0 and int((inputs["input"] == IMAGE_ID).sum()) * 4 == n


def test_digits_splits_are_disjoint_and_balanced():
    train, val = digits("train"), digits("val")
    assert len(train) + len(val) == 1797 and len(val) == DIGITS_HELD_OUT == 179
    # Disjoint by content, not only by index: the held-out accuracy must not be recall of a
    # training image that reappears among the held-out ones.
    seen = {image.numpy().tobytes() for image, _ in train}
    assert not [i for i, (image, _) in enumerate(val) if image.numpy().tobytes() in seen]
    counts = torch.bincount(torch.tensor([label for _, label in val]), minlength=10)
    assert counts.min() >= 15
    assert train[0][0].shape == (3, 56, 56) and 0 <= float(train[0][0].min()) <= 1


def test_a_saved_position_resumes_the_exact_window_sequence(vision, tokenizer, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": "word " * (15 * i + 3)}) + "\n"
                            for i in range(5)))
    documents = [[image, f"a handwritten digit {label}"] for image, label in digits("val")[:7]]

    def dataset():
        return MultimodalDataset([text], documents, tokenizer, seq_len=64, vision=vision,
                                 image_docs_per_text_doc=2)

    first = iter(reference := dataset())
    for _ in range(5):
        next(first)
    state = reference.state_dict()
    expected = [next(first) for _ in range(8)]
    resumed = dataset()
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(iter(resumed), expected, strict=False):
        assert torch.equal(y, ey) and all(torch.equal(x[k], ex[k]) for k in ex)
