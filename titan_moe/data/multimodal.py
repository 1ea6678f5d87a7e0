"""Interleaved image-text documents packed into fixed windows, like text (data/packing.py).

An image becomes ``<|image_start|> + n × <|image|> + <|image_end|>`` with n = its patch count / 4
(one placeholder per merged 2×2 group); the rest of a document is tokenised text, and a document
is ``[bos] + pieces + [eos]``. Windows of ``seq_len + 1`` tokens are cut from the stream as in
``packing``, with two rules for images: an image's tokens lie whole inside one window's input
positions (``0 .. seq_len - 1``), and a window's images fit its ``window_patches`` patch slots.
An image that would break either rule closes the window early: the rest is padding (a document
of its own, labels ignored) and the image opens the next window. Each window carries

    patches [P, 3·14·14]   the window's images' patches, in order, then zeros
    patch_pos [P, 2]       (row, column) of each patch in its image
    patch_image [P]        index of the patch's image in the window, -1 for an empty slot

and the labels of ``<|image|>`` positions are ignored (no loss on predicting a placeholder).

The training stream alternates ``image_docs_per_text_doc`` image documents (``data/images.py``)
with one text document of the corpus; both streams are sharded by data rank and loop forever. An
image that is missing or corrupt skips its document with a warning and is counted
(``data/images_skipped``, which the trainer logs to TensorBoard).
"""

from collections import deque
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from titan_moe.data.corpus import iter_documents, list_data_files, resolve_split
from titan_moe.data.dataloader import Batch, build_dataloader, resolve_data_path
from titan_moe.data.images import (
    Document,
    ImageLoadError,
    PatchLayout,
    image_documents,
    image_patches,
    load_image,
)
from titan_moe.data.packing import IGNORE_INDEX, window_sample

ImagePiece = tuple[list[int], torch.Tensor, torch.Tensor]  # (tokens, patches, positions)


class MultimodalPacker:
    """Packs documents of text-token and image pieces into windows with patch slots."""

    def __init__(self, seq_len: int, vision: PatchLayout, pad_id: int) -> None:
        self.seq_len, self.vision, self.pad_id = seq_len, vision, pad_id
        self.patch_dim = 3 * vision.patch_size**2
        self.tokens: list[int] = []
        self.starts: list[int] = []
        self.images: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.n_patches = 0
        self.pending: deque[list[int] | ImagePiece | None] = deque()

    def add(self, pieces: list[list[int] | ImagePiece]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Add one document; yield the windows it completes.

        The document waits whole in ``pending`` and leaves it piece by piece, so a state saved
        between two yielded windows holds everything not yet emitted (exact resume).
        """
        self.pending.extend([None, *pieces])  # None marks the document start
        while self.pending:
            piece = self.pending[0]
            if piece is None:
                self.starts.append(len(self.tokens))
                self.pending.popleft()
            elif isinstance(piece, list):
                room = self.seq_len + 1 - len(self.tokens)
                self.tokens.extend(piece[:room])
                if len(piece) > room:
                    self.pending[0] = piece[room:]
                else:
                    self.pending.popleft()
                if len(self.tokens) == self.seq_len + 1:
                    yield self.pop()
            elif self._fits(*piece):
                tokens, patches, positions = piece
                self.tokens.extend(tokens)
                self.images.append((patches, positions))
                self.n_patches += len(patches)
                self.pending.popleft()
            else:
                yield self.pop()

    def _fits(self, tokens: list[int], patches: torch.Tensor, _positions: torch.Tensor) -> bool:
        if len(tokens) > self.seq_len or len(patches) > self.vision.window_patches:
            raise ValueError(f"an image of {len(patches)} patches ({len(tokens)} tokens) cannot "
                             f"fit a window of {self.seq_len} tokens and "
                             f"{self.vision.window_patches} patch slots")
        return (len(self.tokens) + len(tokens) <= self.seq_len
                and self.n_patches + len(patches) <= self.vision.window_patches)

    def pop(self) -> tuple[torch.Tensor, ...]:
        """The current window, padded if short: (tokens, starts, valid, patches, pos, image)."""
        window = self.seq_len + 1
        n_real = len(self.tokens)
        tokens = torch.full((window,), self.pad_id, dtype=torch.int64)
        tokens[:n_real] = torch.tensor(self.tokens, dtype=torch.int64)
        starts = torch.zeros(window, dtype=torch.bool)
        starts[[s for s in self.starts if s < n_real]] = True
        valid = torch.zeros(window, dtype=torch.bool)
        valid[:n_real] = True
        if n_real < window:
            starts[n_real] = True  # the padding is a document of its own
        slots = self.vision.window_patches
        patches = torch.zeros(slots, self.patch_dim)
        pos = torch.zeros(slots, 2, dtype=torch.int64)
        image = torch.full((slots,), -1, dtype=torch.int64)
        offset = 0
        for i, (p, xy) in enumerate(self.images):
            patches[offset : offset + len(p)] = p
            pos[offset : offset + len(p)] = xy
            image[offset : offset + len(p)] = i
            offset += len(p)
        # A document still open continues as document 0 of the next window.
        self.tokens, self.starts, self.images, self.n_patches = [], [], [], 0
        return tokens, starts, valid, patches, pos, image

    def __len__(self) -> int:
        return len(self.tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "starts": list(self.starts),
                "images": list(self.images), "pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens, self.starts = list(state["tokens"]), list(state["starts"])
        self.images, self.pending = list(state["images"]), deque(state["pending"])
        self.n_patches = sum(len(p) for p, _ in self.images)


def image_tokens(tokenizer: BaseTokenizer, n_patches: int, group: int) -> list[int]:
    """``<|image_start|> + (n_patches / group) × <|image|> + <|image_end|>``."""
    ids = (tokenizer.image_start_id, tokenizer.image_id, tokenizer.image_end_id)
    if any(i is None for i in ids):
        raise ValueError("the tokenizer has no <|image_start|> / <|image|> / <|image_end|> token")
    return [ids[0]] + [ids[1]] * (n_patches // group) + [ids[2]]


def encode_document(
    pieces: list[str | torch.Tensor], tokenizer: BaseTokenizer, vision: PatchLayout
) -> list[list[int] | ImagePiece]:
    """Text pieces as token lists, images as (tokens, patches, positions); bos first, eos last."""
    out: list[list[int] | ImagePiece] = [[tokenizer.bos_id]]
    for piece in pieces:
        if isinstance(piece, str):
            out.append(tokenizer.encode(piece, add_bos=False, add_eos=False))
        else:
            patches, pos = image_patches(piece, vision)
            out.append((image_tokens(tokenizer, len(patches), vision.merge**2), patches, pos))
    out.append([tokenizer.eos_id])
    return out


def batch_item(window: tuple[torch.Tensor, ...], image_id: int) -> Batch:
    tokens, starts, valid, patches, pos, image = window
    inputs, labels, doc_ids = window_sample(tokens, starts, valid)
    labels[labels == image_id] = IGNORE_INDEX
    return {"input": inputs, "doc_ids": doc_ids, "patches": patches, "patch_pos": pos,
            "patch_image": image}, labels


class MultimodalDataset(IterableDataset, Stateful):
    """One data-parallel rank's endless stream of packed image-text windows."""

    def __init__(
        self,
        text_files: list,
        documents: list[Document],
        tokenizer: BaseTokenizer,
        seq_len: int,
        vision: PatchLayout,
        image_docs_per_text_doc: int = 1,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        text_field: str = "text",
    ) -> None:
        self.text_files, self.documents = text_files, documents
        self.tokenizer, self.vision = tokenizer, vision
        self.image_docs_per_text_doc = image_docs_per_text_doc
        self.dp_rank, self.dp_world_size, self.text_field = dp_rank, dp_world_size, text_field
        self.packer = MultimodalPacker(seq_len, vision, tokenizer.pad_id)
        self.text_read = self.images_read = self.images_skipped = 0
        if len(documents) <= dp_rank:
            raise ValueError(f"{len(documents)} image documents for {dp_world_size} data ranks")

    def _text_documents(self) -> Iterator[str]:
        while True:
            start = self.dp_rank + self.text_read * self.dp_world_size
            read = 0
            for _, text in iter_documents(self.text_files, self.text_field, start,
                                          self.dp_world_size):
                read += 1
                self.text_read += 1
                yield text
            if read == 0 and self.text_read == 0:
                raise ValueError(f"text data shard {self.dp_rank} of {self.dp_world_size} is empty")
            if read == 0:
                self.text_read = 0

    def _image_document(self) -> list[str | torch.Tensor] | None:
        n_shard = len(range(self.dp_rank, len(self.documents), self.dp_world_size))
        index = self.dp_rank + (self.images_read % n_shard) * self.dp_world_size
        self.images_read += 1
        try:
            return [p if isinstance(p, str) else load_image(p) for p in self.documents[index]]
        except ImageLoadError as e:
            self.images_skipped += 1
            logger.warning(f"skipping image document {index}: {e} "
                           f"({self.images_skipped} skipped so far)")
            return None

    def __iter__(self) -> Iterator[Batch]:
        texts = self._text_documents()
        while True:
            for _ in range(self.image_docs_per_text_doc):
                pieces = self._image_document()
                if pieces is not None:
                    yield from self._windows(pieces)
            yield from self._windows([next(texts)])

    def _windows(self, pieces: list[str | torch.Tensor]) -> Iterator[Batch]:
        for window in self.packer.add(encode_document(pieces, self.tokenizer, self.vision)):
            yield batch_item(window, self.tokenizer.image_id)

    def stats(self) -> dict[str, float]:
        """Counters the trainer logs: image documents read and skipped (this rank)."""
        return {"data/images_read": self.images_read, "data/images_skipped": self.images_skipped}

    def state_dict(self) -> dict[str, Any]:
        return {"text_read": self.text_read, "images_read": self.images_read,
                "images_skipped": self.images_skipped, **self.packer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.text_read = state_dict["text_read"]
        self.images_read = state_dict["images_read"]
        self.images_skipped = state_dict["images_skipped"]
        self.packer.load_state_dict(state_dict)


def build_multimodal_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer | None,
    job_config: JobConfig,
    vision: PatchLayout | None = None,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """Text, or text + images when ``training.image_data`` is set; ``vision`` is the vision
    tower's config, which the images need."""
    config = job_config.training
    if not getattr(config, "image_data", ""):
        return build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    if tokenizer is None:
        raise ValueError("the dataloader needs a tokenizer: set TrainSpec.build_tokenizer_fn")
    if vision is None:
        raise ValueError("training.image_data is set but no vision tower config was given")
    path = resolve_data_path(config.dataset, config.dataset_path, "training")
    dataset = MultimodalDataset(
        list_data_files(resolve_split(path, "train")),
        image_documents(config.image_data, "train"),
        tokenizer,
        seq_len=config.seq_len,
        vision=vision,
        image_docs_per_text_doc=config.image_docs_per_text_doc,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        text_field=config.dataset_text_field,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(config.dataloader), "batch_size": config.local_batch_size},
    )
