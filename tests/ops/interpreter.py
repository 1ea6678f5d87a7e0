"""Running an op test file's kernels under Triton's CPU interpreter, in a child process.

The interpreter is picked when @triton.jit decorates and again when Triton lazily imports its
own helpers, so TRITON_INTERPRET=1 has to hold for a whole process: flipping it inside the pytest
process fails in Triton 3.6 and would turn other tests' kernels into interpreted ones. So each
op test file runs its cases in one child process (the file run as a module, from the repo root)
that prints their reports as one JSON line, and its tests read them (the `results` fixture of
conftest.py).

The children take minutes of single-threaded Python together, so conftest.py starts them when
collection ends (`prefetch`), one at a time at the lowest CPU priority: they use the cycles the
tests before them leave idle, and a test that needs one waits only for what is left of it.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# How long a test waits for its file's child once it needs it.
CHILD_TIMEOUT_S = 300
LOWEST_PRIORITY = 19


def guarded(fn, *args) -> dict:
    """fn(*args), or the exception as {"error": ...}, so one failing case names itself."""
    try:
        return fn(*args)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


class _Child:
    """One test file's child process, started by the queue's thread or by the waiting test."""

    def __init__(self, test_file: str) -> None:
        self.test_file = test_file
        self.done = threading.Event()
        self.process: subprocess.Popen | None = None
        self.output: tuple[int, str, str] | None = None

    def run(self, priority: int) -> None:
        module = ".".join(Path(self.test_file).relative_to(REPO).with_suffix("").parts)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module], cwd=REPO,
                env={**os.environ, "TRITON_INTERPRET": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if priority:
                os.setpriority(os.PRIO_PROCESS, self.process.pid, priority)
            stdout, stderr = self.process.communicate()
            self.output = (self.process.returncode, stdout, stderr)
        except Exception as error:
            self.output = (-1, "", f"starting {module}: {type(error).__name__}: {error}")
        finally:
            self.done.set()


_children: dict[str, _Child] = {}
_queue_lock = threading.Lock()
_stopped = threading.Event()


def prefetch(test_files: list[str]) -> None:
    """Start test_files' children in the background, one after another, at the lowest priority
    (a test that waits on one leaves the CPU to it; raising it back would need privileges)."""
    with _queue_lock:
        keys = [str(Path(f).resolve()) for f in test_files]
        queued = [_children.setdefault(k, _Child(k)) for k in keys if k not in _children]

    def run_queue() -> None:
        for child in queued:
            if _stopped.is_set():
                return
            child.run(LOWEST_PRIORITY)

    if queued:
        threading.Thread(target=run_queue, daemon=True, name="interpreter-prefetch").start()


def stop_prefetch() -> None:
    """Kill the children still running and start no more (a session that ends before their
    tests)."""
    _stopped.set()
    for child in _children.values():
        if child.process is not None and child.process.poll() is None:
            child.process.kill()


def interpreted_reports(test_file: str) -> dict:
    """The JSON line test_file's `__main__` prints, run with TRITON_INTERPRET=1: from its
    prefetched child, or from a child started now."""
    key = str(Path(test_file).resolve())
    with _queue_lock:
        child = _children.get(key)
        if child is None:
            child = _children[key] = _Child(key)
            threading.Thread(target=child.run, args=(0,), daemon=True).start()
    if not child.done.wait(CHILD_TIMEOUT_S):
        if child.process is not None:
            child.process.kill()
        raise TimeoutError(f"{test_file}'s interpreter child ran past {CHILD_TIMEOUT_S} s")
    returncode, stdout, stderr = child.output
    assert returncode == 0, stderr[-4000:]
    return json.loads(stdout.splitlines()[-1])
