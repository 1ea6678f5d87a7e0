"""Images for the vision tower: sources of image-text documents and their patches.

A multimodal document is a list of pieces, each a text string or an image (a file path or a
[3, H, W] float tensor in [0, 1]). Sources:

- ``digits``: the 1,797 8×8 handwritten digits that scikit-learn ships (``load_digits``),
  upscaled to 56×56, each with the caption ``"a handwritten digit N"``; the last 179 (10%,
  16-20 of each digit) are held out as the ``val`` split, which no training image repeats.
- a user's ``.jsonl`` file (or a folder of them): one document per line, either an image +
  caption pair ``{"image": "cat.png", "text": "a cat"}`` or an interleaved document
  ``{"content": [{"text": "..."}, {"image": "a.png"}, {"text": "..."}]}``; image paths are
  relative to the jsonl file's folder.

Dynamic resolution: an image keeps its aspect ratio and (up to rounding to whole 2×2 groups of
14-pixel patches) its native size, unless its patch grid would exceed ``max_patches``; then it is
scaled down until the grid fits. Patches come out in merge order (the 4 patches of a 2×2 group
are consecutive) with their (row, column) for the 2-D RoPE.
"""

import json
import math
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

Image = Path | torch.Tensor
Document = list[str | Image]
DIGITS = "digits"
DIGIT_PIXELS = 56
DIGIT_CAPTION = "a handwritten digit"
DIGITS_HELD_OUT = 179  # the last 10% of load_digits' 1,797 images: the ``val`` split


class PatchLayout(Protocol):
    """What the data needs of the vision tower's config (`model.args.VisionArgs` has it)."""

    patch_size: int
    merge: int
    max_patches: int
    window_patches: int


class ImageLoadError(Exception):
    """An image file that is missing or cannot be decoded."""


def load_image(image: Image) -> torch.Tensor:
    """[3, H, W] float32 in [0, 1]; raises ImageLoadError for a missing or corrupt file."""
    if isinstance(image, torch.Tensor):
        return image
    from PIL import Image as PILImage

    try:
        with PILImage.open(image) as f:
            rgb = f.convert("RGB")
    except (OSError, ValueError, PILImage.DecompressionBombError) as e:
        raise ImageLoadError(f"{image}: {e}") from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(rgb.height, rgb.width, 3).permute(2, 0, 1).float() / 255


def patch_grid(height: int, width: int, args: PatchLayout) -> tuple[int, int]:
    """(rows, columns) of patches for an image: even, native-sized, at most max_patches."""
    unit = args.patch_size * args.merge
    rows, cols = max(1, math.ceil(height / unit)), max(1, math.ceil(width / unit))
    budget = args.max_patches // (args.merge * args.merge)
    if rows * cols > budget:
        scale = math.sqrt(budget / (rows * cols))
        rows, cols = max(1, math.floor(rows * scale)), max(1, math.floor(cols * scale))
        while rows * cols > budget:
            if rows >= cols:
                rows -= 1
            else:
                cols -= 1
    return rows * args.merge, cols * args.merge


def image_patches(image: torch.Tensor, args: PatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """patches [N, 3·p·p] (pixels scaled to [-1, 1]) and positions [N, 2] in merge order."""
    p, m = args.patch_size, args.merge
    rows, cols = patch_grid(image.shape[1], image.shape[2], args)
    resized = F.interpolate(image[None].float(), size=(rows * p, cols * p), mode="bilinear",
                            antialias=True, align_corners=False)[0]
    x = (resized * 2 - 1).reshape(3, rows // m, m, p, cols // m, m, p)
    patches = x.permute(1, 4, 2, 5, 0, 3, 6).reshape(rows * cols, 3 * p * p)
    r = torch.arange(rows).view(rows // m, 1, m, 1).expand(-1, cols // m, -1, m)
    c = torch.arange(cols).view(1, cols // m, 1, m).expand(rows // m, -1, m, -1)
    return patches.contiguous(), torch.stack([r.reshape(-1), c.reshape(-1)], dim=-1)


def digits(split: str) -> list[tuple[torch.Tensor, int]]:
    """scikit-learn's digits as ([3, 56, 56] images in [0, 1], label) of one split."""
    if split not in ("train", "val"):
        raise ValueError(f"digits split must be 'train' or 'val', got {split!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("the digits images need scikit-learn: pip install scikit-learn") from e
    data = load_digits()
    images = torch.from_numpy(data.images).float() / 16
    images = F.interpolate(images[:, None], size=(DIGIT_PIXELS, DIGIT_PIXELS), mode="nearest")
    first_held_out = len(images) - DIGITS_HELD_OUT
    chosen = range(first_held_out, len(images)) if split == "val" else range(first_held_out)
    return [(images[i].expand(3, -1, -1), int(data.target[i])) for i in chosen]


def digit_caption(label: int) -> str:
    return f"{DIGIT_CAPTION} {label}"


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob("*.jsonl") if not f.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"no .jsonl files of image documents under {path}")
    return files


def _jsonl_document(record: dict, folder: Path, where: str) -> Document:
    if "content" in record:
        pieces: Document = []
        for piece in record["content"]:
            if "image" in piece:
                pieces.append(folder / piece["image"])
            elif "text" in piece:
                pieces.append(piece["text"])
            else:
                raise KeyError(f"{where}: a content piece needs an 'image' or a 'text' field")
        return pieces
    if "image" in record and "text" in record:
        return [folder / record["image"], record["text"]]
    raise KeyError(f"{where}: a line needs 'image' and 'text' fields, or a 'content' list")


def image_documents(source: str, split: str) -> list[Document]:
    """The documents of an image source: ``digits`` or a .jsonl file / folder of them."""
    if source == DIGITS:
        return [[image, digit_caption(label)] for image, label in digits(split)]
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"training.image_data={source!r}: not {DIGITS!r} and no such .jsonl file or folder")
    split_dir = path / split
    files = _jsonl_files(split_dir if split_dir.is_dir() else path)
    documents = []
    for file in files:
        with file.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    documents.append(
                        _jsonl_document(json.loads(line), file.parent, f"{file}:{line_no}"))
    return documents
