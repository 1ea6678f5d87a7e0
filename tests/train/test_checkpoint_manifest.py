"""Manifest format 2 (titan_moe/train/checkpoint_verify.py) against independent references.

Chunks are patched to 1 KiB (reads to 300 B, so a chunk takes several unaligned reads). The
reference digest of a chunk is hashlib.sha256 over that byte range read on its own; the reference
split is none: two gloo ranks must together read every byte of every file exactly once, and their
manifest must equal the one-process manifest byte for byte (as JSON). Digests are exact; there is
no tolerance. The last test runs the trainer itself on two gloo processes (default chunks): the
save and the resume go through VerifiedCheckpoints on both ranks.
"""

import dataclasses
import hashlib
import json
import pickle
import random
import shutil
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.distributed.train_jobs import ROOT, register, shared_runs
from tests.train.manifest_ranks import Args, flip_byte, two_ranks
from tests.train.test_checkpoint_resume import TINY
from titan_moe.train import checkpoint_verify as cv

CHUNK = 1024
# (relative path, bytes) of a step folder: several chunks with a short last one, exactly one
# chunk, less than a chunk, an empty file, a file in a subfolder.
FILES = [("__0_0.distcp", 5 * CHUNK + 7), ("__1_0.distcp", 2 * CHUNK), (".metadata", 300),
         ("empty", 0), ("sub/extra.bin", CHUNK)]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cv, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(cv, "READ_BYTES", 300)


def make_step(step_dir: Path, seed: int, files=FILES) -> None:
    rng = random.Random(seed)
    for name, size in files:
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(rng.randbytes(size))


def read_range(path: Path, start: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(start)
        return f.read(length)


def reference_digests(path: Path, chunk: int) -> list[str]:
    """sha256 of each byte range [i·chunk, (i+1)·chunk) of path, each read on its own."""
    size = path.stat().st_size
    return [hashlib.sha256(read_range(path, s, chunk)).hexdigest() for s in range(0, size, chunk)]


def manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / cv.MANIFEST).read_text())


@pytest.mark.parametrize("size", [0, 1000, CHUNK, 3 * CHUNK + 5], ids=[
    "empty", "less-than-a-chunk", "one-chunk", "several-chunks"])
def test_chunk_digests_equal_hashlib_over_each_range(tmp_path, small_chunks, size):
    make_step(tmp_path, 0, [("shard", size)])
    cv.write_manifest(tmp_path, Args())
    written = manifest(tmp_path)
    assert written["format"] == 2
    assert written["files"] == {"shard": {"bytes": size, "chunk_bytes": CHUNK,
                                          "sha256": reference_digests(tmp_path / "shard", CHUNK)}}
    assert len(written["files"]["shard"]["sha256"]) == -(-size // CHUNK)
    cv.verify_checkpoint(tmp_path, Args())


def test_the_first_damaged_chunk_in_manifest_order_is_named(tmp_path, small_chunks):
    make_step(tmp_path, 0)
    cv.write_manifest(tmp_path, Args())
    flip_byte(tmp_path / "__1_0.distcp", CHUNK + 3)
    flip_byte(tmp_path / "__0_0.distcp", 4 * CHUNK + 1)
    flip_byte(tmp_path / "__0_0.distcp", 2 * CHUNK + 9)
    shard, size = tmp_path / "__0_0.distcp", 5 * CHUNK + 7
    with pytest.raises(cv.CheckpointError) as error:
        cv.verify_checkpoint(tmp_path, Args())
    assert str(error.value) == (
        f"{shard} is damaged: its sha256 differs from the manifest's in chunk 2 of 6, bytes "
        f"[{2 * CHUNK}, {3 * CHUNK}) of {size}")


def test_a_format_1_manifest_verifies_and_detects_a_flipped_byte(tmp_path):
    make_step(tmp_path, 0)
    (tmp_path / cv.MANIFEST).write_text(json.dumps({
        "format": 1, "model_args": cv.model_args_json(Args()),
        "files": {name: {"bytes": size,
                         "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
                  for name, size in FILES}}))
    cv.verify_checkpoint(tmp_path, Args())
    shard, size = tmp_path / "sub/extra.bin", CHUNK
    flip_byte(shard, 100)
    with pytest.raises(cv.CheckpointError) as error:
        cv.verify_checkpoint(tmp_path, Args())
    assert str(error.value) == (f"{shard} is damaged: its sha256 differs from the manifest's in "
                                f"chunk 0 of 1, bytes [0, {size}) of {size}")


@pytest.mark.parametrize("form", [3, "2", None], ids=["3", "string", "absent"])
def test_an_unknown_format_is_named(tmp_path, form):
    make_step(tmp_path, 0)
    written = {"model_args": cv.model_args_json(Args()), "files": {}}
    if form is not None:
        written["format"] = form
    (tmp_path / cv.MANIFEST).write_text(json.dumps(written))
    with pytest.raises(cv.CheckpointError) as error:
        cv.verify_checkpoint(tmp_path, Args())
    assert str(error.value) == (f"{tmp_path / cv.MANIFEST} has format {form!r}; this version "
                                "reads formats 1, 2")


def test_a_chunk_list_of_the_wrong_length_is_named(tmp_path, small_chunks):
    make_step(tmp_path, 0)
    cv.write_manifest(tmp_path, Args())
    written = manifest(tmp_path)
    written["files"]["__0_0.distcp"]["sha256"].pop()
    (tmp_path / cv.MANIFEST).write_text(json.dumps(written))
    with pytest.raises(cv.CheckpointError, match="lists 5 digests for __0_0.distcp, whose 5127 "
                                                  "bytes make 6 chunks"):
        cv.verify_checkpoint(tmp_path, Args())


def test_the_split_balances_bytes_and_is_a_partition():
    chunks = [c for name, size in FILES for c in cv.file_chunks(name, size, CHUNK)]
    shares = [cv.share(chunks, rank, 3) for rank in range(3)]
    key = dataclasses.astuple
    assert sorted((c for s in shares for c in s), key=key) == sorted(chunks, key=key)
    loads = [sum(c.length for c in s) for s in shares]
    assert max(loads) - min(loads) <= CHUNK, loads


def test_an_error_that_cannot_travel_between_ranks_travels_as_its_message():
    class Unpicklable(OSError):
        def __init__(self) -> None:
            super().__init__("disk gone")
            self.handle = lambda: None

    assert repr(cv._portable(Unpicklable())) == repr(RuntimeError("Unpicklable: disk gone"))
    damaged = cv._Failure("bad chunk", (2, 1))
    assert cv._portable(damaged) is damaged
    copy = pickle.loads(pickle.dumps(damaged))  # its place in the manifest travels with it
    assert (type(copy), str(copy), copy.order) == (cv._Failure, "bad chunk", (2, 1))


@pytest.mark.slow
def test_two_ranks_hash_disjoint_shares_and_agree(tmp_path, small_chunks):
    """The manifest two gloo ranks write equals one process's; each rank read a disjoint share
    and together every byte; a damaged chunk that rank 1 hashed is the same error on both ranks,
    and both resume the older step."""
    root, one, out = tmp_path / "ranks", tmp_path / "one", tmp_path / "out"
    for step, seed in (("step-1", 1), ("step-2", 2)):
        (root / step).mkdir(parents=True)
        make_step(root / step, seed)
    shutil.copytree(root, one)
    out.mkdir()
    for step in ("step-1", "step-2"):
        cv.write_manifest(one / step, Args())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(two_ranks, args=(port, str(root), str(out), CHUNK), nprocs=2, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    for step in ("step-1", "step-2"):
        assert manifest(root / step) == manifest(one / step), step
    sizes = {f"{step}/{name}": size for step in ("step-1", "step-2") for name, size in FILES}
    for phase, steps in (("write_reads", ("step-1", "step-2")), ("verify_reads", ("step-2",))):
        everything = sorted(tuple(r) for rank in ranks for r in rank[phase])
        assert len(set(everything)) == len(everything), f"{phase}: a range read twice"
        for rank in ranks:
            assert sum(length for _, _, length in rank[phase]) > 0, f"{phase}: a rank read nothing"
        covered: dict[str, int] = {}
        for name, start, length in everything:
            assert covered.get(name, 0) == start, (phase, name, start)
            covered[name] = start + length
        assert covered == {k: v for k, v in sizes.items() if k.startswith(steps) and v}, phase

    name, start, length = ranks[1]["damaged"]
    assert [name, start, length] in ranks[1]["verify_reads"]
    assert [name, start, length] not in ranks[0]["verify_reads"]
    relative = name.split("/", 1)[1]
    size = dict(FILES)[relative]
    expected = (f"{root / name} is damaged: its sha256 differs from the manifest's in chunk "
                f"{start // CHUNK} of {-(-size // CHUNK)}, bytes [{start}, {start + length}) of "
                f"{size}")
    assert [rank["error"] for rank in ranks] == [expected, expected]
    assert [rank["resume"] for rank in ranks] == [1, 1]


# The resume tests' tiny run on two gloo processes (FSDP over both), saving every step: 2 steps,
# then (the step-2 folder kept as written, its rank-1 shard damaged) 3 steps in the same folder,
# launched with the other test modules' trainer runs (tests/distributed/train_jobs.py).
TWO_RANKS = [*TINY, "--checkpoint.interval", "1"]
register("manifest/written", 2, [*TWO_RANKS, "--training.steps", "2"], dump="manifest")
register("manifest/resumed", 2, [*TWO_RANKS, "--training.steps", "3"], dump="manifest",
         before=["tests.train.manifest_ranks:keep_and_damage", f"{ROOT}/manifest/checkpoint/step-2",
                 f"{ROOT}/manifest_step-2_as_written"])


@pytest.mark.slow
def test_the_trainer_on_two_ranks_writes_and_verifies_format_2(tmp_path_factory):
    """Both ranks' shards are in the manifest, each chunk's digest that of hashlib over its
    range; a damaged shard makes both ranks skip that step and load the one before."""
    runs = shared_runs(tmp_path_factory)
    dump, log = runs["manifest/resumed"]
    step_dir = runs["manifest/written"][0].parent / "manifest_step-2_as_written"
    written = manifest(step_dir)
    assert written["format"] == 2
    assert set(written["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    for name, want in written["files"].items():
        assert want == {"bytes": (step_dir / name).stat().st_size,
                        "chunk_bytes": cv.CHUNK_BYTES,
                        "sha256": reference_digests(step_dir / name, cv.CHUNK_BYTES)}, name
    # The damaged shard's size, that of the shard as written (the resumed run writes step-2
    # anew): less than a chunk, one chunk.
    shard = dump / "checkpoint" / "step-2" / "__1_0.distcp"
    size = (step_dir / shard.name).stat().st_size
    log = log.splitlines()
    skip = (f"Skipping checkpoint step-2: {shard} is damaged: its sha256 differs from the "
            f"manifest's in chunk 0 of 1, bytes [0, {size}) of {size}")
    assert [line.split(" - WARNING - ", 1)[1] for line in log
            if " - WARNING - Skipping" in line] == [skip, skip]
    loaded = [line.rstrip(".").split()[-1] for line in log if "Loading the checkpoint" in line]
    assert loaded == [str(dump / "checkpoint" / "step-1")] * 2
