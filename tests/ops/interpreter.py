"""Running an op test file's kernels under Triton's CPU interpreter, in a child process.

The interpreter is picked when @triton.jit decorates and again when Triton lazily imports its
own helpers, so TRITON_INTERPRET=1 has to hold for a whole process: flipping it inside the pytest
process fails in Triton 3.6 and would turn other tests' kernels into interpreted ones. So each
op test file runs its cases in one child process (the file run as a module, from the repo root)
that prints their reports as one JSON line, and its tests read them (the `results` fixture of
conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 300


def guarded(fn, *args) -> dict:
    """fn(*args), or the exception as {"error": ...}, so one failing case names itself."""
    try:
        return fn(*args)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def interpreted_reports(test_file: str) -> dict:
    """The JSON line test_file's `__main__` prints, run with TRITON_INTERPRET=1."""
    module = ".".join(Path(test_file).resolve().relative_to(REPO).with_suffix("").parts)
    child = subprocess.run(
        [sys.executable, "-m", module], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.splitlines()[-1])
