"""The JSON every benchmark writes: its arguments and its rows."""

import argparse
import json
from pathlib import Path


def write_json(out: Path, opts: argparse.Namespace, rows: list[dict]) -> None:
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(opts).items()},
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
