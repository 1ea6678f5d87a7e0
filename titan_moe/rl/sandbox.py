"""Run untrusted Python in a child process with CPU-time, memory and wall-clock limits.

The child gets `resource.setrlimit` limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE 0)
before exec, runs isolated (`python -I`) in an empty temporary folder with an empty environment,
in its own session so that a timeout kills everything it started. A hang, a crash (signal) or
running out of memory is reported in the result; it never raises.
"""

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

OUTPUT_LIMIT = 4000  # characters of stdout/stderr kept


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    @property
    def failure(self) -> str:
        """'' when ok, else 'timeout', 'signal N' or 'exit N'."""
        if self.timed_out:
            return "timeout"
        if self.returncode is not None and self.returncode < 0:
            return f"signal {-self.returncode}"
        return "" if self.returncode == 0 else f"exit {self.returncode}"


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run `code` as a script; wall limit timeout_s, CPU limit the same rounded up (a timeout)."""
    cpu_s = max(1, int(timeout_s + 0.999))
    memory = memory_mb * 1024 * 1024

    def limit() -> None:
        # The soft limit sends SIGXCPU (which ends the child); the hard limit is the backstop.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code], cwd=folder, env={}, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=limit, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout_s)
            # An idle machine runs a busy loop at one CPU second per second, so the CPU limit can
            # fire before the wall limit: both are the same hang.
            timed_out = proc.returncode == -signal.SIGXCPU
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    return SandboxResult(proc.returncode, out[:OUTPUT_LIMIT], err[-OUTPUT_LIMIT:], timed_out)
