"""Verified checkpoints: a manifest per step folder, checked before torchtitan loads it.

torchtitan 0.2.2's CheckpointManager saves `<dump>/<checkpoint.folder>/step-N/` with DCP (every
rank writes its `__<rank>_<i>.distcp` shards into the one folder, the coordinator then writes
`.metadata`) and on resume loads the newest step-N holding a `.metadata` (`_find_load_step`).
Nothing checks the bytes: a damaged shard loads silently, a truncated one ends the run in an
EOFError. Nor is the model compared: a model of another size loads whatever keys match.

After the save returned on every rank (all shards and `.metadata` written), the step gets
`step-N/manifest.json`, format 2: {"format": 2, "model_args": {...}, "files": {relative path:
{"bytes": n, "chunk_bytes": c, "sha256": [hex of bytes [0, c), [c, 2c), ..., the last chunk
shorter; none for an empty file]}}} over every other file in the folder. Rank 0 writes it to a
temporary name, fsyncs and renames it, so a manifest is whole or absent. A step folder without
one was cut short (or predates manifests). Format 1 ({"bytes", "sha256": one whole-file hex})
still verifies, as one chunk a file.

Why chunks: format 1 had rank 0 alone hash every file, one core, on save and again on resume.
The proxy's save on one H100 (2026-12-05) took 96 s: ~60 s of DCP writing and 35 s of hashing its
one ~30 GB `__0_0.distcp` (~1 GB/s); at full size one rank would hash every rank's shards, for
hours. The (file, chunk) pairs are the unit of work instead: split over the ranks (longest
first, each to the rank with the fewest bytes so far: the same split on every rank), each rank
hashing its share in `hash_threads()` threads (os.preadv and hashlib release the GIL), so one
large shard is hashed by several threads and ranks at once.

Rank 0 lists the folders (a step's files on save, the step folders on resume) and broadcasts the
list, so every rank splits the same work even where a shared filesystem's listings lag. Save:
each rank hashes its share, the digests are gathered to rank 0, which writes the manifest.
Verify (every rank, the same outcome everywhere):
- every rank reads the manifest and compares its model args first: a difference is a config
  error, not damage, so it raises ModelArgsMismatch naming each field (checkpoint vs config
  value) instead of falling back;
- the sizes (each rank stats its share of the files), then the chunks (each rank hashes its
  share): the failures are gathered and every rank raises the same CheckpointError, naming the
  first bad file in manifest order (and the chunk, with its byte range).
Resume (load_step -1) loads the newest step-N that verifies; each newer one is skipped with a
warning saying why (no manifest, a file missing, truncated or with other bytes). An explicit
`checkpoint.load_step`, or an `initial_load_path` that has a manifest, is verified: a
CheckpointError names the file if it does not verify. No rank is left waiting in a collective
while another raised: each step's errors travel with its collective, and every rank raises.

Async checkpointing is rejected: the manifest would have to wait for the background upload.
"""

import dataclasses
import hashlib
import heapq
import json
import os
import pickle
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

MANIFEST = "manifest.json"
FORMAT = 2
READ_FORMATS = (1, 2)
# The unit of work: 256 MiB is ~0.25 s of one core's sha256, so a 30 GB shard is ~120 items to
# spread over threads and ranks, and a manifest of hundreds of such shards stays a few MB.
CHUNK_BYTES = 256 << 20
# One read's size: large enough that a read and an update release the GIL for long, small enough
# that a thread's buffer stays small (16 threads hold 128 MiB).
READ_BYTES = 8 << 20
# More threads than this gain nothing on one node's disk or page cache.
MAX_THREADS = 16
# Model args that may differ between save and load: max_seq_len follows training.seq_len
# (context stages grow it), kda_backend and router_gemm pick a kernel implementation; none of
# them shapes a weight.
UNCOMPARED_ARGS = frozenset({"max_seq_len", "kda_backend", "router_gemm"})
_ABSENT = "<absent>"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged; the message names the folder or file."""


class ModelArgsMismatch(ValueError):
    """A checkpoint saved for other model args; the message names each differing field."""


class _Failure(CheckpointError):
    """One bad file or chunk; `order` (its place in the manifest) picks, of the failures every
    rank found, the one every rank raises."""

    def __init__(self, message: str, order: tuple[int, ...]) -> None:
        super().__init__(message)
        self.order = order

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.order)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Bytes [start, start + length) of the step folder's file `name`, the index-th chunk."""

    name: str
    index: int
    start: int
    length: int


def model_args_json(model_args: Any) -> dict[str, Any]:
    """The model args as JSON reads them back (tuples become lists), for comparison."""
    return json.loads(json.dumps(dataclasses.asdict(model_args)))


def file_chunks(name: str, size: int, chunk_bytes: int) -> list[Chunk]:
    """The chunks of a file of `size` bytes: every chunk_bytes, the last shorter, none if empty."""
    return [Chunk(name, i, start, min(chunk_bytes, size - start))
            for i, start in enumerate(range(0, size, chunk_bytes))]


def hash_range(path: Path, start: int, length: int) -> str:
    """sha256 of bytes [start, start + length) of path, read READ_BYTES at a time."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(min(READ_BYTES, length)))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            read = os.preadv(fd, [buffer[:min(READ_BYTES, length - done)]], start + done)
            if read == 0:
                raise CheckpointError(f"{path} ends at byte {start + done}, inside bytes "
                                      f"[{start}, {start + length}) being hashed")
            digest.update(buffer[:read])
            done += read
    finally:
        os.close(fd)
    return digest.hexdigest()


def hash_threads() -> int:
    """Threads a rank hashes with: the cores this process may run on, shared by the ranks of its
    node (torchrun's LOCAL_WORLD_SIZE), at most MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_THREADS, (cores or 1) // ranks))


def in_threads(work: Callable[[Chunk], Any], chunks: list[Chunk], threads: int) -> list[Any]:
    """work(chunk) for each chunk (results in the order given), run by `threads` threads."""
    if not chunks:
        return []
    with ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
        return list(pool.map(work, chunks))


def chunk_digests(step_dir: Path, chunks: list[Chunk], threads: int) -> list[str]:
    """The sha256 of each chunk of step_dir's files (in the order given), by `threads` threads."""
    return in_threads(lambda c: hash_range(step_dir / c.name, c.start, c.length), chunks, threads)


def _rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def share(chunks: Iterable[Chunk], rank: int, world: int) -> list[Chunk]:
    """Rank `rank`'s share of chunks: longest first (ties in the order given), each to the rank
    with the fewest bytes so far (ties to the lowest rank). The same on every rank; no rank gets
    more than one chunk's bytes above another's."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for chunk in sorted(chunks, key=lambda c: -c.length):
        load, owner = heapq.heappop(loads)
        if owner == rank:
            mine.append(chunk)
        heapq.heappush(loads, (load + chunk.length, owner))
    return mine


def _portable(error: Exception) -> Exception:
    """error, or a RuntimeError with its type and message if it does not survive pickling: an
    object collective would fail on some ranks only, leaving the others waiting."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # any failure to round-trip: the message still travels
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _on_rank0(compute: Callable[[], Any]) -> Any:
    """compute() run on rank 0 only (a listing or a write done once) and its result, or its
    error, handed to every rank, so that no rank is left waiting in a collective."""
    rank, world = _rank_world()
    if world == 1:
        return compute()
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome = [(compute(), None)]
        except Exception as e:  # any error: re-raised on every rank below
            outcome = [(None, _portable(e))]
    dist.broadcast_object_list(outcome, src=0)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def _agreed(compute: Callable[[], Any]) -> Any:
    """compute() run on every rank, its result kept; if it raised on any rank, every rank raises
    the same error: a _Failure first in manifest order, or else the lowest rank's."""
    try:
        result, error = compute(), None
    except Exception as e:  # any error: gathered and raised on every rank below
        result, error = None, e
    if _rank_world()[1] == 1:
        errors = [error]
    else:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else _portable(error))
    raised = [(getattr(e, "order", ()), rank, e) for rank, e in enumerate(errors) if e is not None]
    if raised:
        raise min(raised, key=lambda t: t[:2])[2]
    return result


def _list_files(step_dir: Path) -> list[tuple[str, int]]:
    """Every file under step_dir (relative path, bytes) but the manifest and its temporary: one
    left by a save killed while writing it is overwritten, then renamed away, by the next."""
    skip = {step_dir / MANIFEST, step_dir / f".{MANIFEST}.partial"}
    return [(str(p.relative_to(step_dir)), p.stat().st_size)
            for p in sorted(step_dir.rglob("*")) if p.is_file() and p not in skip]


def write_manifest(step_dir: Path, model_args: Any) -> None:
    """Write step_dir/manifest.json (format 2) on rank 0: every file's size and chunk digests,
    and the model args. Called on every rank (each hashes its share), or in one process."""
    rank, world = _rank_world()
    files = _on_rank0(lambda: _list_files(step_dir))
    chunks = [c for name, size in files for c in file_chunks(name, size, CHUNK_BYTES)]
    mine = share(chunks, rank, world)
    try:
        outcome = (dict(zip(mine, chunk_digests(step_dir, mine, hash_threads()), strict=True)),
                   None)
    except Exception as e:  # any error: raised on every rank by the write below
        outcome = ({}, e)
    outcomes = [outcome]
    if world > 1:
        outcomes = [None] * world if rank == 0 else None
        part, error = outcome
        dist.gather_object((part, None if error is None else _portable(error)), outcomes, dst=0)

    def write() -> None:
        digests: dict[Chunk, str] = {}
        for part, error in outcomes:
            if error is not None:
                raise error
            digests.update(part)
        manifest = {
            "format": FORMAT,
            "model_args": model_args_json(model_args),
            "files": {name: {"bytes": size, "chunk_bytes": CHUNK_BYTES,
                             "sha256": [digests[c] for c in file_chunks(name, size, CHUNK_BYTES)]}
                      for name, size in files},
        }
        partial = step_dir / f".{MANIFEST}.partial"
        with partial.open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, step_dir / MANIFEST)

    _on_rank0(write)


def compare_model_args(saved: dict[str, Any], model_args: Any, step_dir: Path) -> None:
    """Raise ModelArgsMismatch naming every field where the checkpoint and config differ."""
    current = model_args_json(model_args)
    differing = [
        f"{name}: checkpoint {saved.get(name, _ABSENT)!r} vs config {current.get(name, _ABSENT)!r}"
        for name in sorted((saved.keys() | current.keys()) - UNCOMPARED_ARGS)
        if saved.get(name, _ABSENT) != current.get(name, _ABSENT)
    ]
    if differing:
        raise ModelArgsMismatch(
            f"checkpoint {step_dir} was saved for other model args: {'; '.join(differing)}; "
            "train with the checkpoint's model config, or start a fresh checkpoint.folder")


@dataclasses.dataclass(frozen=True)
class _Expected:
    """One file as its manifest records it: size, chunks and their digests."""

    name: str
    size: int
    chunks: list[Chunk]
    sha256: list[str]


def _read_manifest(step_dir: Path, model_args: Any) -> list[_Expected]:
    """The manifest's files, in its order, after its model args are compared."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{step_dir} has no {MANIFEST}: its save was cut short, or it predates manifests")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from e
    form = manifest.get("format") if isinstance(manifest, dict) else None
    if form not in READ_FORMATS:
        raise CheckpointError(f"{path} has format {form!r}; this version reads formats "
                              f"{', '.join(map(str, READ_FORMATS))}")
    try:
        saved_args, files = manifest["model_args"], manifest["files"]
        expected = []
        for name, want in files.items():
            size = want["bytes"]
            if form == 1:  # one whole-file digest: one chunk, of no bytes for an empty file
                chunks, sha256 = [Chunk(name, 0, 0, size)], [want["sha256"]]
            else:
                chunks, sha256 = file_chunks(name, size, want["chunk_bytes"]), want["sha256"]
            if len(sha256) != len(chunks):
                raise CheckpointError(f"{path} lists {len(sha256)} digests for {name}, whose "
                                      f"{size} bytes make {len(chunks)} chunks")
            expected.append(_Expected(name, size, chunks, sha256))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a format-{form} manifest ({e!r})") from e
    compare_model_args(saved_args, model_args, step_dir)
    return expected


def _size_failures(step_dir: Path, files: list[_Expected], rank: int, world: int) -> None:
    """Raise a _Failure for the first of this rank's share of files missing or of another size."""
    for order, want in list(enumerate(files))[rank::world]:
        file = step_dir / want.name
        if not file.is_file():
            raise _Failure(f"{file} is missing", (order,))
        size = file.stat().st_size
        if size != want.size:
            raise _Failure(f"{file} has {size} bytes, the manifest {want.size} "
                           "(truncated or overwritten)", (order,))


def _chunk_failures(step_dir: Path, files: list[_Expected], rank: int, world: int) -> None:
    """Hash this rank's share of the chunks; raise a _Failure for the first, in manifest order,
    whose bytes differ from the manifest's or cannot be read."""
    order = {c: (i, c.index) for i, want in enumerate(files) for c in want.chunks}

    def check(chunk: Chunk) -> _Failure | None:
        want = files[order[chunk][0]]
        file = step_dir / chunk.name
        where = (f"chunk {chunk.index} of {len(want.chunks)}, bytes "
                 f"[{chunk.start}, {chunk.start + chunk.length}) of {want.size}")
        try:
            digest = hash_range(file, chunk.start, chunk.length)
        except (OSError, CheckpointError) as e:
            return _Failure(f"{file} cannot be read in {where}: {e}", order[chunk])
        if digest != want.sha256[chunk.index]:
            return _Failure(f"{file} is damaged: its sha256 differs from the manifest's in "
                            f"{where}", order[chunk])
        return None

    failures = [f for f in in_threads(check, share(order, rank, world), hash_threads()) if f]
    if failures:
        raise min(failures, key=lambda f: f.order)


def verify_checkpoint(step_dir: Path, model_args: Any) -> None:
    """Raise unless step_dir has a manifest for these model args (ModelArgsMismatch) that its
    files match (CheckpointError naming the first file, in manifest order, that does not).
    Called on every rank (each checks its share; every rank raises the same error), or in one
    process."""
    rank, world = _rank_world()

    def sizes() -> list[_Expected]:
        files = _read_manifest(step_dir, model_args)
        _size_failures(step_dir, files, rank, world)
        return files

    files = _agreed(sizes)
    _agreed(lambda: _chunk_failures(step_dir, files, rank, world))


def _step_numbers(folder: Path) -> list[int]:
    return sorted((int(m.group(1)) for p in folder.iterdir()
                   if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()), reverse=True)


def newest_verified_step(folder: Path, model_args: Any) -> int:
    """The newest step-N under folder that verifies, or -1; logs each newer one skipped. Called
    on every rank (each verifies its share; all reach the same answer), or in one process."""
    steps = _on_rank0(lambda: _step_numbers(folder))
    for step in steps:
        try:
            verify_checkpoint(folder / f"step-{step}", model_args)
            return step
        except CheckpointError as e:
            logger.warning(f"Skipping checkpoint step-{step}: {e}")
    if steps:
        logger.warning(f"No checkpoint under {folder} verifies; training starts from scratch")
    return -1


class VerifiedCheckpoints:
    """Wraps a CheckpointManager's save (a manifest after each save) and load (of a step that
    verifies; nothing when resume finds none)."""

    def __init__(self, checkpointer: CheckpointManager, model_args: Any) -> None:
        self.checkpointer = checkpointer
        self.model_args = model_args
        if not checkpointer.enable:
            return
        if checkpointer.async_mode != AsyncMode.DISABLED:
            raise ValueError(
                f"checkpoint.async_mode = {checkpointer.async_mode.value!r} is not supported: "
                "checkpoints are verified by a manifest written after the save completes; "
                "use async_mode = \"disabled\"")
        self._save, self._load = checkpointer.save, checkpointer.load
        checkpointer.save, checkpointer.load = self.save, self.load

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """The wrapped save; when it saved, every rank hashes its share of the step's manifest."""
        saving = self.checkpointer._should_save(curr_step, last_step)
        self._save(curr_step, last_step)
        if saving:
            write_manifest(Path(self.checkpointer._create_checkpoint_id(curr_step)),
                           self.model_args)

    def load(self, step: int = -1) -> bool:
        """The wrapped load, of the step `step_to_load` picks (the same on every rank); False
        if none."""
        step = self.step_to_load(step)
        return step is not None and self._load(step)

    def step_to_load(self, step: int) -> int | None:
        """The step for torchtitan's load: -1 resolved to the newest that verifies (None when
        none does), an explicit step verified; -1 kept when the folder does not exist yet
        (torchtitan then loads initial_load_path, verified here when it has a manifest).
        Called on every rank: rank 0 looks at the folders, every rank verifies its share."""
        folder = Path(self.checkpointer.folder)
        if not _on_rank0(folder.is_dir):
            initial = self.checkpointer.initial_load_path
            if initial and _on_rank0((Path(initial) / MANIFEST).is_file):
                verify_checkpoint(Path(initial), self.model_args)
            return step
        if step != -1:
            verify_checkpoint(Path(self.checkpointer._create_checkpoint_id(step)),
                              self.model_args)
            return step
        found = newest_verified_step(folder, self.model_args)
        return None if found == -1 else found
