"""Two gloo ranks writing and verifying manifests (tests/train/test_checkpoint_manifest.py).

Each rank records the byte ranges it hashes (checkpoint_verify.hash_range wrapped), writes the
manifests of step-1 and step-2, verifies step-2 intact, then rank 0 flips a byte in a chunk that
rank 1 hashed; both verify step-2 again and resume. Each rank's record is written as JSON.
"""

import dataclasses
import json
import shutil
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from titan_moe.train import checkpoint_verify as cv


@dataclasses.dataclass
class Args:
    """Model args of the tests' manifests."""

    dim: int = 8
    layers: tuple[int, ...] = (1, 2)


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def keep_and_damage(step_dir: str, keep: str) -> None:
    """Copy a written step folder to `keep`, then damage its rank-1 shard in the middle: the
    trainer test's work between its two runs (tests/distributed/train_jobs.py calls it)."""
    shutil.copytree(step_dir, keep)
    shard = Path(step_dir) / "__1_0.distcp"
    flip_byte(shard, shard.stat().st_size // 2)


def two_ranks(rank: int, port: int, root: str, out: str, chunk_bytes: int) -> None:
    """One rank of two: see the module docstring. Fails rather than waits (60 s timeout)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    cv.CHUNK_BYTES = chunk_bytes
    cv.READ_BYTES = 300  # several reads a chunk, not aligned with it
    folder, model_args = Path(root), Args()
    reads: list[list] = []
    hash_range = cv.hash_range

    def recording(path: Path, start: int, length: int) -> str:
        reads.append([Path(path).relative_to(folder).as_posix(), start, length])
        return hash_range(path, start, length)

    cv.hash_range = recording
    record: dict = {}
    cv.write_manifest(folder / "step-1", model_args)
    cv.write_manifest(folder / "step-2", model_args)
    record["write_reads"], reads[:] = list(reads), []
    cv.verify_checkpoint(folder / "step-2", model_args)
    record["verify_reads"], reads[:] = list(reads), []
    verify_reads: list = [None, None]
    dist.all_gather_object(verify_reads, record["verify_reads"])
    name, start, length = max(verify_reads[1], key=lambda r: (r[0].endswith(".distcp"), r[1]))
    record["damaged"] = [name, start, length]
    if rank == 0:
        flip_byte(folder / name, start + length // 2)
    dist.barrier()
    try:
        cv.verify_checkpoint(folder / "step-2", model_args)
    except cv.CheckpointError as e:
        record["error"] = str(e)
    record["resume"] = cv.newest_verified_step(folder, model_args)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
