"""The sandbox: a hang is killed at the wall limit, a crash and a memory bomb are reported, and
the Python env scores them 0 while a correct submission scores 1."""

import random
import time

import pytest

from titan_moe.rl.envs.python_exec import PythonExecEnv
from titan_moe.rl.sandbox import run_python

pytestmark = pytest.mark.usefixtures("sandbox_isolation")


def test_hang_crash_and_memory_are_contained():
    began = time.perf_counter()
    hang = run_python("while True: pass", timeout_s=1.0)
    assert hang.timed_out and hang.failure == "timeout"
    assert time.perf_counter() - began < 5
    crash = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert crash.failure == "signal 11"
    bomb = run_python("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert not bomb.ok and "MemoryError" in bomb.stderr
    assert run_python("print(6 * 7)").stdout.strip() == "42"


def test_python_env_rewards():
    env = PythonExecEnv(timeout_s=1.0)
    episode = env.reset(random.Random(0))
    episode.task = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    assert env.step(episode, "def add(a, b):\n    return a + b").reward == 0.5
    hung = env.step(env.reset(random.Random(0)), "while True: pass")
    assert hung.done and hung.reward == 0 and hung.info == "timeout"
