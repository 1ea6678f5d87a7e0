"""The torchtitan dataloader: sharded, packed, exactly resumable document windows.

Shard ``s = dp_rank * n_workers + worker`` of ``n = dp_world_size * n_workers`` reads documents
``s, s + n, s + 2n, ...`` of the corpus stream (``corpus.iter_documents``), tokenizes each as
``[bos] + text + [eos]`` and packs them (``packing``). The shard's position is
``(epoch, docs_read, token buffer)``: the next document is ``s + docs_read * n`` and the buffer
holds the tokens already read but not yet emitted, so loading a saved position continues the
exact batch sequence. Infinite loaders loop over the corpus in the same order every epoch;
finite loaders (validation) pad the last partial window and restart from the beginning on the
next pass. Batches are ``({"input": [B, T] int64, "doc_ids": [B, T] int32}, labels [B, T])``.
A bad document (``corpus.BadDocument``) stops the loader with its file:line, or with
``skip_bad_documents`` is skipped with a warning and counted (``data/skipped_documents``, which
the trainer logs; with dataloader workers each worker counts its own and the trainer sees none).
"""

import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from titan_moe.data.corpus import BadDocument, iter_documents, list_data_files, resolve_split
from titan_moe.data.packing import DocumentPacker, window_sample
from titan_moe.data.pystdlib import prepare_pystdlib

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

# Named datasets that are built locally on first use, under ./data/<name>.
LOCAL_DATASETS = {"pystdlib": prepare_pystdlib}
DATA_ROOT = Path("data")


class PackedTextDataset(IterableDataset, Stateful):
    """One data-parallel rank's stream of packed ``seq_len`` windows."""

    def __init__(
        self,
        files: list[Path],
        tokenizer: BaseTokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        text_field: str = "text",
        shuffle_windows: int = 0,
        seed: int = 0,
        min_doc_tokens: int = 0,
        skip_bad_documents: bool = False,
    ):
        self.files = files
        self.tokenizer = tokenizer
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.text_field = text_field
        pad_id = getattr(tokenizer, "pad_id", None)
        self.pad_id = pad_id if pad_id is not None else (tokenizer.eos_id or 0)
        self.epoch = 0
        self.docs_read = 0
        self.packer = DocumentPacker(seq_len + 1)
        # Later context stages train on long documents only (their data mix).
        self.min_doc_tokens = min_doc_tokens
        # Windows wait in a buffer and leave it in a seeded random order: consecutive windows of
        # one long document would otherwise fill whole batches, and Quantile Balancing fits each
        # step's expert bias on the previous step's tokens, so it needs steps that look alike.
        self.shuffle_windows = shuffle_windows
        self.shuffle_buffer: list[tuple[torch.Tensor, ...]] = []
        self.rng = torch.Generator().manual_seed(seed + dp_rank)
        self.on_bad = self._skip_bad if skip_bad_documents else None
        self.skipped_documents = 0

    def _shard(self) -> tuple[int, int]:
        worker = get_worker_info()
        n_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        return self.dp_rank * n_workers + worker_id, self.dp_world_size * n_workers

    @staticmethod
    def _batch_item(window: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Batch:
        inputs, labels, doc_ids = window_sample(*window)
        return {"input": inputs, "doc_ids": doc_ids}, labels

    def __iter__(self) -> Iterator[Batch]:
        shard, n_shards = self._shard()
        while True:
            whole_pass, kept = self.docs_read == 0, 0
            start = shard + self.docs_read * n_shards
            documents = iter_documents(self.files, self.text_field, start, n_shards, self.on_bad)
            for _, text in documents:
                tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)
                self.docs_read += 1
                if len(tokens) < self.min_doc_tokens:
                    continue
                kept += 1
                self.packer.add(tokens)
                while self.packer.ready():
                    window = self._shuffled(self.packer.pop())
                    if window is not None:
                        yield self._batch_item(window)
            if not self.infinite:
                if len(self.packer):
                    self.shuffle_buffer.append(self.packer.pop_padded(self.pad_id))
                while self.shuffle_buffer:
                    yield self._batch_item(self.shuffle_buffer.pop())
                self.docs_read = 0
                return
            if self.docs_read == 0:
                raise ValueError(
                    f"data shard {shard} of {n_shards} is empty: the corpus has fewer documents "
                    "than data-parallel ranks x dataloader workers"
                )
            if whole_pass and kept == 0:
                raise ValueError(
                    f"no document of data shard {shard} is usable: {self.skipped_documents} bad, "
                    f"the rest shorter than training.min_doc_tokens = {self.min_doc_tokens}"
                )
            self.epoch += 1
            self.docs_read = 0

    def _skip_bad(self, error: BadDocument) -> None:
        # The skipped document keeps its place in the stream, so the resume position counts it.
        self.docs_read += 1
        self.skipped_documents += 1
        logger.warning(f"skipping bad document {error} ({self.skipped_documents} skipped so far)")

    def stats(self) -> dict[str, float]:
        """Counters the trainer logs: bad documents skipped (this rank)."""
        return {"data/skipped_documents": self.skipped_documents}

    def _shuffled(self, window: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        """Put a window into the shuffle buffer; once it is full, take a random one out."""
        if self.shuffle_windows <= 1:
            return window
        self.shuffle_buffer.append(window)
        if len(self.shuffle_buffer) < self.shuffle_windows:
            return None
        i = int(torch.randint(len(self.shuffle_buffer), (), generator=self.rng))
        self.shuffle_buffer[i], self.shuffle_buffer[-1] = (
            self.shuffle_buffer[-1], self.shuffle_buffer[i])
        return self.shuffle_buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "docs_read": self.docs_read,
            "shuffle_buffer": [list(w) for w in self.shuffle_buffer],
            "rng": self.rng.get_state(),
            "skipped_documents": self.skipped_documents,
            **self.packer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.docs_read = state_dict["docs_read"]
        self.shuffle_buffer = [tuple(w) for w in state_dict.get("shuffle_buffer", [])]
        if "rng" in state_dict:
            self.rng.set_state(state_dict["rng"])
        self.skipped_documents = state_dict.get("skipped_documents", 0)
        self.packer.load_state_dict(state_dict)


SPLITS = {"training": "train", "validation": "val"}


def check_data_source(name: str, path: str | None, section: str) -> None:
    """Raise OSError naming the config field unless the data can be found or built.

    An explicit path must hold data files of the section's split, readable and not all empty.
    """
    if path:
        if not Path(path).exists():
            raise FileNotFoundError(
                f"{section}.dataset_path={path!r} does not exist; point it at a .jsonl / "
                ".parquet / .txt file or a folder of them"
            )
        try:
            files = list_data_files(resolve_split(path, SPLITS[section]))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{section}.dataset_path={path!r}: {e}") from None
        unreadable = [f for f in files if not os.access(f, os.R_OK)]
        if unreadable:
            raise PermissionError(f"{section}.dataset_path={path!r}: cannot read {unreadable[0]}"
                                  f" ({len(unreadable)} unreadable files)")
        if all(f.stat().st_size == 0 for f in files):
            raise FileNotFoundError(f"{section}.dataset_path={path!r}: all {len(files)} data "
                                    "files are empty")
    elif name not in LOCAL_DATASETS:
        raise FileNotFoundError(
            f"{section}.dataset_path is not set and {section}.dataset={name!r} is not a local "
            f"dataset ({', '.join(LOCAL_DATASETS)}); set {section}.dataset_path to a .jsonl / "
            ".parquet / .txt file or a folder of them"
        )


def resolve_data_path(name: str, path: str | None, section: str) -> Path:
    """The corpus location for config ``section`` ("training" or "validation").

    An explicit ``{section}.dataset_path`` wins; otherwise ``{section}.dataset`` must name a
    local dataset, which is prepared under ``./data/<name>`` if missing.
    """
    check_data_source(name, path, section)
    if path:
        return Path(path)
    folder = DATA_ROOT / name
    LOCAL_DATASETS[name](folder)
    return folder


def _build(
    section: str,
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer | None,
    job_config: JobConfig,
    infinite: bool,
) -> ParallelAwareDataloader:
    if tokenizer is None:
        raise ValueError("the dataloader needs a tokenizer: set TrainSpec.build_tokenizer_fn")
    config = getattr(job_config, section)
    path = resolve_data_path(config.dataset, config.dataset_path, section)
    dataset = PackedTextDataset(
        list_data_files(resolve_split(path, SPLITS[section])),
        tokenizer,
        seq_len=config.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        text_field=getattr(config, "dataset_text_field", "text"),
        shuffle_windows=getattr(config, "shuffle_windows", 0) if infinite else 0,
        min_doc_tokens=getattr(config, "min_doc_tokens", 0),
        skip_bad_documents=getattr(config, "skip_bad_documents", False),
        seed=job_config.debug.seed or 0,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(config.dataloader), "batch_size": config.local_batch_size},
    )


def build_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer | None,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """TrainSpec ``build_dataloader_fn``: ``training.*`` config, the ``train`` split."""
    return _build("training", dp_world_size, dp_rank, tokenizer, job_config, infinite)


def build_validation_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer | None,
    job_config: JobConfig,
    infinite: bool = False,
) -> ParallelAwareDataloader:
    """The validation loader: ``validation.*`` config, the ``val`` split."""
    return _build("validation", dp_world_size, dp_rank, tokenizer, job_config, infinite)
