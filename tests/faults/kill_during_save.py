"""`--experimental.custom_import tests.faults.kill_during_save`: the training process SIGKILLs
itself (kill -9: no exception, no cleanup, no flush) in the middle of one checkpoint save.

$KILL_DURING_SAVE = "<step>:<point>" picks the save of `step-<step>` and the point in it:
- `shards`: every shard file (`__<rank>_<i>.distcp`) is written, DCP's `.metadata` is not
  (torch.distributed.checkpoint's FileSystemWriter.finish is about to write it);
- `metadata`: DCP's save is complete (`.metadata` written: torchtitan on its own would load this
  step), the trainer has not yet written the step's `manifest.json`;
- `manifest`: the manifest has been written to its temporary name, not yet renamed to
  `manifest.json` (the `os.replace` onto that name is about to run).
Just before the kill it prints `kill_during_save: SIGKILL in the save of step-<step> at <point>`
to stderr, so a test can tell this kill from any other death.

Only torch's storage writer and `os.replace` are wrapped: production code has no test hook.
"""

import os
import signal
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

POINTS = ("shards", "metadata", "manifest")
_step, _, POINT = os.environ.get("KILL_DURING_SAVE", "").partition(":")
STEP_DIR = f"step-{_step}"
if _step and POINT not in POINTS:
    raise ValueError(f"KILL_DURING_SAVE={_step}:{POINT}: the point is one of {POINTS}")


def _kill() -> None:
    print(f"kill_during_save: SIGKILL in the save of {STEP_DIR} at {POINT}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_finish = FileSystemWriter.finish


def finish(self, metadata, results) -> None:
    """DCP's last step of a save on the coordinator: write `.metadata`."""
    ours = _step and Path(self.path).name == STEP_DIR
    if ours and POINT == "shards":
        _kill()
    _finish(self, metadata, results)
    if ours and POINT == "metadata":
        _kill()


_replace = os.replace


def replace(src, dst, **kwargs) -> None:
    dst_path = Path(os.fsdecode(dst))
    if (_step and POINT == "manifest" and dst_path.name == "manifest.json"
            and dst_path.parent.name == STEP_DIR):
        _kill()
    _replace(src, dst, **kwargs)


if _step:
    FileSystemWriter.finish = finish
    os.replace = replace
