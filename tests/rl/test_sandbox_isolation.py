"""Each way out of the sandbox fails: reading or writing outside its scratch, the network, root,
a fork bomb, a detached grandchild; and without isolation it raises instead of running the code.

The escape tests skip (naming what is missing) where the machine cannot isolate.
"""

import socket
import time
import uuid
from pathlib import Path

import pytest

import titan_moe
from titan_moe.rl import sandbox_init
from titan_moe.rl.envs.python_exec import PythonExecEnv
from titan_moe.rl.sandbox import SandboxUnavailable, isolation, run_python

PROJECT = Path(titan_moe.__file__).resolve().parent
TRY = """
def attempt(what, action):
    try:
        action()
        print("escaped", what)
    except OSError as e:
        print("blocked", what, type(e).__name__)
"""


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (the sandboxed code's text is in its argv)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # it exited while we looked
            pass
    return pids


def _process_count() -> int:
    return sum(entry.name.isdigit() for entry in Path("/proc").iterdir())


@pytest.mark.usefixtures("sandbox_isolation")
class TestEscapes:
    def test_files_outside_the_view_cannot_be_read(self, tmp_path):
        secret = tmp_path / "secret.txt"
        secret.write_text("host secret")
        paths = [secret, PROJECT / "rl" / "sandbox.py", Path("/etc/passwd")]
        code = TRY + "".join(f"attempt({str(p)!r}, lambda: print(open({str(p)!r}).read()))\n"
                             for p in paths)
        result = run_python(code)
        assert result.ok, result.stderr
        assert "host secret" not in result.stdout and "import" not in result.stdout
        assert result.stdout.split("\n")[:3] == [f"blocked {p} FileNotFoundError" for p in paths]

    def test_writes_outside_scratch_fail_and_leave_targets_as_they_were(self, tmp_path):
        existing = tmp_path / "existing.txt"
        existing.write_text("original")
        new_in_project = PROJECT / f"escape-{uuid.uuid4().hex}.txt"
        targets = [existing, tmp_path / "new.txt", new_in_project, Path("/escape.txt"),
                   Path("/usr/escape.txt")]
        code = TRY + "".join(f"attempt({str(t)!r}, lambda: open({str(t)!r}, 'w').write('x'))\n"
                             for t in targets)
        code += "open('/tmp/scratch.txt', 'w').write('ok'); print(open('/tmp/scratch.txt').read())"
        result = run_python(code)
        assert result.ok, result.stderr
        lines = result.stdout.split("\n")
        attempts, scratch = lines[: len(targets)], lines[len(targets)]
        assert all(a.startswith(f"blocked {t} ") for a, t in zip(attempts, targets, strict=True))
        assert scratch == "ok"  # the scratch itself is writable
        assert existing.read_text() == "original"
        assert not (tmp_path / "new.txt").exists() and not new_in_project.exists()
        assert not Path("/escape.txt").exists()

    def test_scratch_is_fresh_for_each_call(self):
        assert run_python("open('/tmp/left.txt', 'w').write('x')").ok
        second = run_python("import os; print(os.listdir('/tmp'))")
        assert second.stdout.strip() == "[]"

    def test_no_network_reaches_a_host_listener(self):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            code = TRY + ("import socket\nattempt('connect', lambda: socket.create_connection("
                          f"('127.0.0.1', {port}), timeout=2))\n")
            result = run_python(code)
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing ever connected
                listener.accept()
        assert result.stdout.startswith("blocked connect "), result.stdout + result.stderr

    def test_runs_as_nobody_not_root(self):
        result = run_python("import os; print(os.getuid(), os.geteuid(), os.getgid(), "
                            "os.getegid(), os.getgroups())")
        nobody = sandbox_init.NOBODY
        assert result.stdout.strip() == f"{nobody} {nobody} {nobody} {nobody} []"

    def test_process_count_is_limited(self):
        code = ("import os, time\ncount = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n"
                "    count += 1\nprint(count)")
        result = run_python(code)
        assert result.ok, result.stderr
        assert 0 < int(result.stdout) < sandbox_init.MAX_PROCESSES  # its own slot counts too

    def test_fork_bomb_ends_at_the_timeout_and_leaves_nothing(self):
        marker = uuid.uuid4().hex
        before = _process_count()
        code = (f"# {marker}\nimport os, time\nwhile True:\n    try:\n        os.fork()\n"
                "    except OSError:\n        time.sleep(0.01)\n")
        began = time.perf_counter()
        result = run_python(code, timeout_s=1.5)
        assert result.timed_out
        assert time.perf_counter() - began < 1.5 + 3
        assert _processes_with(marker) == []
        assert _process_count() <= before + 10  # others share this machine: a little slack

    def test_detached_grandchild_is_gone_when_the_call_returns(self):
        marker = uuid.uuid4().hex
        code = (f"# {marker}\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n"
                "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
                "os.wait()\nprint('parent done')")
        began = time.perf_counter()
        result = run_python(code, timeout_s=5.0)
        assert result.ok and result.stdout.strip() == "parent done", result.stderr
        assert time.perf_counter() - began < 3  # the sleeper held stdout: it did not wait 60 s
        assert _processes_with(marker) == []


class TestUnavailable:
    @pytest.fixture(autouse=True)
    def fresh_probe(self):
        isolation.cache_clear()
        yield
        isolation.cache_clear()

    def test_missing_unshare_raises_and_runs_nothing(self, tmp_path, monkeypatch):
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(SandboxUnavailable, match="`unshare` is not on PATH"):
            run_python("print('ran')")
        with pytest.raises(SandboxUnavailable, match="unshare"):
            PythonExecEnv()

    def test_refused_namespaces_raise_what_failed(self, tmp_path, monkeypatch):
        fake = tmp_path / "unshare"
        fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\n"
                        "exit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(SandboxUnavailable, match="unshare failed: Operation not permitted"):
            run_python("print('ran')")
