"""Training runs in processes of their own, as `python -m titan_moe.train` would start them, but
without paying its ~5 s of imports per run: each run is a process forked from a multiprocessing
fork server that has imported `titan_moe.train.trainer` once and computed nothing (no thread pool to
inherit). The run's process sets its environment and working directory, sends its stdout and
stderr (file descriptors 1 and 2) to a log file and calls `titan_moe.train.trainer.main(argv)`;
its exit status is main's (0, 1 on an exception, or -9 when it was SIGKILLed). torchtitan's
train() ends with a 2 s sleep "for other ranks to complete", which a run of one process skips
here (no rank to wait for; the only sleep in torchtitan/train.py).
"""

import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["titan_moe.train.trainer"])


class Run(NamedTuple):
    returncode: int
    log: str


class NoSleep:
    """The time module, less its sleep."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        pass


def _train(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives until exit)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torchtitan.train

    from titan_moe.train.trainer import main

    torchtitan.train.time = NoSleep()

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "2")))  # the env var is read at import
    status = 1
    try:
        main(argv)
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def train_process(argv: list[str], env: dict[str, str], cwd: Path, log: Path,
                  timeout: float = 300) -> Run:
    """Run `titan_moe.train.trainer.main(argv)` in a fresh process: its exit status and output."""
    process = _CONTEXT.Process(target=_train, args=(argv, env, str(cwd), str(log)))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise TimeoutError(f"training did not end in {timeout} s: {log.read_text()[-4000:]}")
    return Run(process.exitcode, log.read_text())
