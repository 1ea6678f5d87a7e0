"""The op tests' interpreter children (tests/ops/interpreter.py): each runs its file as a module
under TRITON_INTERPRET=1; one prefetched when collection ends runs at the lowest CPU priority, so
it takes only the cycles the tests before it leave idle; one a test starts itself runs at the
test's priority. This file's own `__main__` is the child: it reports what it ran under."""

import json
import os
import threading

import pytest

from tests.ops import interpreter


@pytest.fixture
def fresh_queue(monkeypatch):
    """No child started or cached yet (the session's own children are left alone)."""
    monkeypatch.setattr(interpreter, "_children", {})
    monkeypatch.setattr(interpreter, "_stopped", threading.Event())


def test_prefetched_child_runs_under_the_interpreter_at_the_lowest_priority(fresh_queue):
    interpreter.prefetch([__file__])
    report = interpreter.interpreted_reports(__file__)
    assert report == {"interpret": "1", "nice": interpreter.LOWEST_PRIORITY}


def test_child_a_test_starts_runs_at_its_priority(fresh_queue):
    report = interpreter.interpreted_reports(__file__)
    assert report == {"interpret": "1", "nice": os.getpriority(os.PRIO_PROCESS, 0)}


if __name__ == "__main__":
    print(json.dumps({"interpret": os.environ.get("TRITON_INTERPRET"),
                      "nice": os.getpriority(os.PRIO_PROCESS, 0)}))
