"""PID 1 of a sandbox: builds the sandbox's root, runs the tool code in it as nobody, reports.

sandbox.py starts this file (stdlib only: it runs with `python -I -S`) under `unshare`, as root
of fresh mount, network, PID, IPC and UTS namespaces (and, for a trainer that is not root, of a
user namespace that maps root to the trainer). It

1. mounts a tmpfs over ROOT (an empty host folder) and fills it with read-only, nosuid, nodev
   bind mounts of the interpreter's view (VIEW and sys.base_prefix), /dev/{null,zero,random,
   urandom} and a size-limited tmpfs scratch at /tmp, then moves it onto / and chroots there:
   nothing else of the host's file system is reachable;
2. forks the tool process, which drops to uid/gid NOBODY in a user namespace of its own (so that
   RLIMIT_NPROC counts its processes alone), sets its rlimits and no_new_privs and execs
   `python -I -c CODE` in /tmp; it is PID 2, since PID 1 ignores signals it does not handle (a
   tool that kills itself must die);
3. waits for it at most WALL_S, writes one line to STATUS_FD ("status <wait status>", or
   "error <why>" when the sandbox could not be built) and exits, which kills every process left
   in the PID namespace (detached ones too) and frees the namespaces' mounts.

usage: sandbox_init.py ROOT STATUS_FD OUTER_ID WALL_S CPU_S MEMORY_BYTES CODE
OUTER_ID is the uid and gid, in this process's user namespace, that NOBODY maps to: NOBODY itself
for a root trainer (no user namespace), 0 (the trainer) otherwise.
"""

import ctypes
import os
import resource
import select
import signal
import sys

NOBODY = 65534
VIEW = ("/usr", "/bin", "/lib", "/lib64", "/sbin")  # with sys.base_prefix: what Python needs
DEVICES = ("null", "zero", "random", "urandom")
SCRATCH_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 20
MAX_PROCESSES = 32
MAX_OPEN_FILES = 64

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE = 1, 2, 4, 32, 4096, 8192
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    result = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags),
                         _bytes(data))
    _check(result, f"mount {source} on {target}")


def _bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(source, target, None, MS_BIND)
    if read_only:  # a bind mount takes its flags only from a remount
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _view() -> list[str]:
    """VIEW and the interpreter's prefix, without paths inside another one."""
    paths = sorted({*VIEW, os.path.realpath(sys.base_prefix)})
    return [p for p in paths if not any(p.startswith(q + "/") for q in paths if q != p)]


def build_root(root: str, outer_id: int) -> None:
    """Make `root` the root of this mount namespace, holding only the view, devices, scratch."""
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in _view():
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            _bind(path, root + path, read_only=True)
    for device in DEVICES:
        _bind(f"/dev/{device}", f"{root}/dev/{device}", read_only=False)
    os.mkdir(f"{root}/tmp")
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={SCRATCH_BYTES},mode=700,uid={outer_id},gid={outer_id}")
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")


def _become_nobody(proc: int, outer_id: int) -> None:
    """Drop to NOBODY in a new user namespace: no capabilities outside it, its own NPROC count."""
    if outer_id == NOBODY:  # real root (no outer user namespace): shed its groups and uid first
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl dumpable")  # own /proc/self files
    _check(_libc.unshare(CLONE_NEWUSER), "unshare user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} {outer_id} 1"),
                       ("gid_map", f"{NOBODY} {outer_id} 1")):
        fd = os.open(f"self/{name}", os.O_WRONLY, dir_fd=proc)
        os.write(fd, text.encode())
        os.close(fd)
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def _limit(cpu_s: int, memory_bytes: int) -> None:
    # The soft CPU limit sends SIGXCPU (which ends the process); the hard limit is the backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")


def start_tool(proc: int, outer_id: int, cpu_s: int, memory_bytes: int, code: str) -> int:
    """Fork the tool process; return its pid once it has exec'd (OSError with its setup error)."""
    error_read, error_write = os.pipe()  # closed on exec: EOF means the exec happened
    pid = os.fork()
    if pid == 0:
        try:
            os.close(error_read)
            _become_nobody(proc, outer_id)
            _limit(cpu_s, memory_bytes)
            os.chdir("/tmp")
            os.execve(sys.executable, [sys.executable, "-I", "-c", code], {})
        except BaseException as e:
            os.write(error_write, f"tool setup: {e}".encode())
        os._exit(127)
    os.close(error_write)
    with os.fdopen(error_read, "rb") as pipe:
        error = pipe.read().decode()
    if error:
        os.waitpid(pid, 0)
        raise OSError(error)
    return pid


def wait_status(pid: int, wall_s: float) -> int:
    """The tool's wait status; SIGKILL after wall_s (the host's own limit is shorter)."""
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], wall_s)[0]:
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def main(argv: list[str]) -> None:
    root, status_fd, outer_id, wall_s, cpu_s, memory_bytes, code = argv
    status_fd, outer_id = int(status_fd), int(outer_id)
    os.set_inheritable(status_fd, False)
    # The tool may share this process's uid (trainer not root): unreadable memory (no ptrace),
    # and PID 1 ignores SIGINT from it like every signal without a handler.
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl dumpable")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = os.open("/proc", os.O_DIRECTORY)  # the host's /proc, kept past the chroot
        build_root(root, outer_id)
        pid = start_tool(proc, outer_id, int(cpu_s), int(memory_bytes), code)
    except OSError as e:
        os.write(status_fd, f"error {e}\n".encode())
        sys.exit(1)
    os.write(status_fd, f"status {wait_status(pid, float(wall_s))}\n".encode())


if __name__ == "__main__":
    main(sys.argv[1:])
