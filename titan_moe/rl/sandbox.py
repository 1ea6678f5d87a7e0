"""Run untrusted Python isolated by kernel namespaces, with CPU-time, memory and wall limits.

The code runs under `unshare` (util-linux) in fresh mount, network, PID, IPC and UTS namespaces
(plus a user namespace when the trainer is not root); sandbox_init.py, PID 1 there, gives it a
root holding only a read-only view of the interpreter and stdlib, /dev/null and friends and a
fresh size-limited tmpfs scratch at /tmp (gone with the call), no network (only a down loopback),
uid/gid 65534 (nobody) in a user namespace of its own, rlimits (CPU, address space, file size,
open files, processes, no core) and no_new_privs. Every process it starts, detached ones too,
dies with the PID namespace when the call returns.

A hang, a crash (signal) or running out of memory is reported in the result; it never raises.
Where isolation is unavailable (no `unshare`, or the kernel refuses the namespaces) every call
raises SandboxUnavailable saying what failed: the code never runs unisolated.
"""

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from titan_moe.rl import sandbox_init

OUTPUT_LIMIT = 4000  # characters of stdout/stderr kept
NAMESPACES = ("--mount", "--propagation=private", "--net", "--pid", "--ipc", "--uts", "--fork",
              "--kill-child")  # --kill-child: killing unshare on a timeout kills PID 1 too
USER_NAMESPACE = ("--user", "--map-root-user")  # what lets an ordinary user mount and chroot
INTERPRETER = os.path.realpath(sys.executable)  # the real binary: a venv's symlink needs the venv
INIT_GRACE_S = 1.0  # PID 1 kills the tool this long after the host's limit, if the host is gone


class SandboxUnavailable(RuntimeError):
    """The kernel isolation the sandbox needs is missing here; nothing was run."""


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
    return _run(isolation(), code, timeout_s, memory_mb)


@functools.cache  # only a working sandbox is cached: a failed probe raises and is tried again
def isolation() -> tuple[str, ...]:
    """The `unshare` command line the sandbox runs under, once a probe ran in it as nobody."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("sandbox isolation unavailable: util-linux `unshare` is not on "
                                 "PATH (it provides the mount, network and PID namespaces)")
    command = (unshare, *([] if os.geteuid() == 0 else USER_NAMESPACE), *NAMESPACES)
    where = f"sandbox isolation unavailable: a probe under `{' '.join(command)}`"
    try:
        probe = _run(command, "import os; print(os.getuid())", timeout_s=10.0, memory_mb=512)
    except SandboxUnavailable as e:
        raise SandboxUnavailable(f"{where} failed: {e}") from None
    if probe.stdout.strip() != str(sandbox_init.NOBODY):
        raise SandboxUnavailable(f"{where} did not run as nobody ({probe.failure or 'ok'}): "
                                 f"{probe.stdout.strip()} {probe.stderr.strip()}")
    return command


def _run(command: tuple[str, ...], code: str, timeout_s: float, memory_mb: int) -> SandboxResult:
    cpu_s = max(1, int(timeout_s + 0.999))
    outer_id = sandbox_init.NOBODY if os.geteuid() == 0 else 0  # see sandbox_init's OUTER_ID
    status_read, status_write = os.pipe()
    with tempfile.TemporaryDirectory(prefix="sandbox-root-") as root:  # only a mount point
        init = [INTERPRETER, "-I", "-S", sandbox_init.__file__, root, str(status_write),
                str(outer_id), str(timeout_s + INIT_GRACE_S), str(cpu_s),
                str(memory_mb * 1024 * 1024), code]
        try:
            proc = subprocess.Popen(
                [*command, "--", *init], cwd=root, env={}, text=True, pass_fds=(status_write,),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
        except OSError:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # unshare may have just exited
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    with os.fdopen(status_read) as pipe:
        status = pipe.read().strip()
    kind, _, value = status.partition(" ")
    if kind == "error" or (kind != "status" and not timed_out):
        raise SandboxUnavailable(f"sandbox could not be built: {value or err.strip()[-500:]}")
    returncode = os.waitstatus_to_exitcode(int(value)) if kind == "status" else None
    # An idle machine runs a busy loop at one CPU second per second, so the CPU limit can fire
    # before the wall limit: both are the same hang.
    timed_out = timed_out or returncode == -signal.SIGXCPU
    return SandboxResult(returncode, out[:OUTPUT_LIMIT], err[-OUTPUT_LIMIT:], timed_out)
