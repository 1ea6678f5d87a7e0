"""Checkpoint manifest hashing on the host CPU: format 2's chunk digests by 1 thread and by the
module's thread count, against format 1's one whole-file sha256.

    python bench/checkpoint_manifest.py            # a 2 GiB file in the system's temporary folder
    python bench/checkpoint_manifest.py --gib 1

Writes a temporary file of --gib GiB (one random 64 MiB block repeated: sha256 costs the same
for any bytes), then times, median of --repeats, each of
  format 1      hashlib.file_digest over the whole file (what rank 0 did per file before);
  format 2 x1   checkpoint_verify.chunk_digests over the file's CHUNK_BYTES chunks, 1 thread;
  format 2 xN   the same with checkpoint_verify.hash_threads() threads (what a rank uses).
The file was just written, so it is read mostly from the page cache: this is the CPU side of the
hashing, which a cold disk or a network filesystem can cap lower. Prints GB/s, writes JSON (--out).
"""

import argparse
import datetime
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from report import write_json

from titan_moe.cli_args import positive, positive_float
from titan_moe.train import checkpoint_verify as cv

BLOCK = 64 << 20


def write_file(path: Path, size: int) -> None:
    block = os.urandom(BLOCK)
    with path.open("wb") as f:
        for start in range(0, size, BLOCK):
            f.write(block[:min(BLOCK, size - start)])


def cpu_model() -> str:
    """The host CPU's name (/proc/cpuinfo), which sets one core's sha256 rate."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), "unknown")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=positive_float, default=2.0, help="file size in GiB")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the file is written")
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" /
                        f"checkpoint_manifest-{today}-cpu.json")
    opts = parser.parse_args(argv)
    size = int(opts.gib * (1 << 30))
    threads = cv.hash_threads()
    with tempfile.TemporaryDirectory(dir=opts.dir) as folder:
        path = Path(folder) / "__0_0.distcp"
        write_file(path, size)
        chunks = cv.file_chunks(path.name, size, cv.CHUNK_BYTES)

        def whole() -> str:
            with path.open("rb") as f:
                return hashlib.file_digest(f, "sha256").hexdigest()

        cases = [("format 1", 1, whole),
                 ("format 2 x1", 1, lambda: cv.chunk_digests(path.parent, chunks, 1)),
                 (f"format 2 x{threads}", threads,
                  lambda: cv.chunk_digests(path.parent, chunks, threads))]
        rows = []
        for name, n, fn in cases:
            fn()  # warm-up: the page cache, the thread pool's first start
            seconds = median_seconds(fn, opts.repeats)
            rows.append({"case": name, "threads": n, "bytes": size, "chunks": len(chunks),
                         "chunk_bytes": cv.CHUNK_BYTES, "seconds": seconds,
                         "gb_per_s": size / seconds / 1e9, "cpus": os.cpu_count(),
                         "cpu_model": cpu_model()})
            print(f"{name:<14} {n:3d} threads  {seconds:7.3f} s  {rows[-1]['gb_per_s']:6.2f} GB/s",
                  flush=True)
    print(f"{opts.gib:g} GiB, {len(chunks)} chunks of {cv.CHUNK_BYTES >> 20} MiB, "
          f"{os.cpu_count()} CPUs; median of {opts.repeats}")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
