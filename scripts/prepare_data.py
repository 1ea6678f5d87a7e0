"""Prepare the default real-text corpus (CPython's stdlib) as jsonl shards.

    python scripts/prepare_data.py --out data/pystdlib [--max-mb 32] [--force]

Writes ``OUT/{train,val}/NNNNN.jsonl`` and ``OUT/manifest.json``; see
``titan_moe/data/pystdlib.py`` for what is selected and how. Skips if OUT is already prepared.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_moe.data.pystdlib import MANIFEST, prepare_pystdlib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/pystdlib", help="output folder")
    parser.add_argument("--max-mb", type=float, default=32.0, help="corpus cap in MiB of text")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="held-out documents")
    parser.add_argument("--seed", type=int, default=0, help="document shuffle seed")
    parser.add_argument("--shard-mb", type=float, default=8.0, help="jsonl shard size in MiB")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    args = parser.parse_args()

    out = Path(args.out)
    if (out / MANIFEST).is_file() and not args.force:
        print(f"{out} is already prepared (pass --force to rebuild)")
        return
    begin = time.perf_counter()
    manifest = prepare_pystdlib(
        out,
        max_bytes=int(args.max_mb * 2**20),
        val_fraction=args.val_fraction,
        seed=args.seed,
        shard_bytes=int(args.shard_mb * 2**20),
        force=args.force,
    )
    print(json.dumps(manifest["splits"], indent=2))
    print(f"prepared {out} from {manifest['source']} in {time.perf_counter() - begin:.1f}s")


if __name__ == "__main__":
    main()
