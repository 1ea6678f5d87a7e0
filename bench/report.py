"""The JSON every benchmark writes: where it ran (device, torch, triton), its arguments and rows."""

import argparse
import json
import platform
from pathlib import Path

import torch
import triton


def environment() -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def write_json(out: Path, opts: argparse.Namespace, rows: list[dict]) -> None:
    out.write_text(json.dumps({"environment": environment(),
                               "args": {k: str(v) for k, v in vars(opts).items()},
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
