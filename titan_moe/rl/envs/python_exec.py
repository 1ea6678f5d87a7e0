"""Python tasks that carry their own tests, run in the sandbox (isolated; time, memory limits).

Each turn the model writes code. A turn that starts with `# run` is a tool call: the code runs
and its output (or error, or "timeout") comes back as the observation. Any other turn is the
submission: the code runs followed by the task's tests, each one an `assert` counted separately;
the reward is the fraction that pass. A submission that hangs, crashes or exhausts memory scores
0 for its own trajectory only.
"""

import random
import re

from titan_moe.rl.env import Episode, StepResult
from titan_moe.rl.sandbox import isolation, run_python

TASKS = [
    ("Write add(a, b) returning a + b.",
     ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]),
    ("Write reverse(s) returning the string s reversed.",
     ["assert reverse('abc') == 'cba'", "assert reverse('') == ''", "assert reverse('x') == 'x'"]),
    ("Write is_even(n) returning True when n is even.",
     ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"]),
    ("Write square(n) returning n * n.",
     ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]),
    ("Write maximum(xs) returning the largest element of a non-empty list.",
     ["assert maximum([1, 5, 2]) == 5", "assert maximum([-3]) == -3",
      "assert maximum([2, 2]) == 2"]),
    ("Write fib(n) returning the n-th Fibonacci number, fib(0) = 0, fib(1) = 1.",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55"]),
]
_PASSED = re.compile(r"^PASSED (\d+) (\d+)$", re.M)


def test_harness(code: str, tests: list[str]) -> str:
    """The submission followed by a loop that runs each test on its own and prints the count."""
    return (f"{code}\n\n__tests = {tests!r}\n__passed = 0\nfor __t in __tests:\n"
            "    try:\n        exec(__t)\n        __passed += 1\n    except Exception:\n"
            "        pass\nprint(f'PASSED {__passed} {len(__tests)}')\n")


class PythonExecEnv:
    def __init__(self, max_turns: int = 3, timeout_s: float = 3.0, memory_mb: int = 512) -> None:
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        isolation()  # a machine without the sandbox's isolation fails here, not in every rollout

    def reset(self, rng: random.Random) -> Episode:
        description, tests = rng.choice(TASKS)
        prompt = f"{description} Start a turn with '# run' to execute code first.\n"
        return Episode(prompt, task=tests)

    def step(self, episode: Episode, action: str) -> StepResult:
        episode.turns += 1
        if action.lstrip().startswith("# run") and episode.turns < self.max_turns:
            result = run_python(action, self.timeout_s, self.memory_mb)
            output = result.stdout + result.stderr
            return StepResult(done=False, observation=f"\n{result.failure or 'ok'}\n{output}\n")
        result = run_python(test_harness(action, episode.task), self.timeout_s, self.memory_mb)
        counted = _PASSED.findall(result.stdout)
        if not result.ok or not counted:
            return StepResult(done=True, info=result.failure or "no test count")
        passed, total = map(int, counted[-1])
        return StepResult(done=True, reward=passed / total, success=passed == total)
