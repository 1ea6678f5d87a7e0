"""Fixtures of the op tests."""

import pytest

from tests.ops.interpreter import interpreted_reports, prefetch, stop_prefetch


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the interpreter children of the selected tests' files, in the order they run."""
    files = [str(item.path) for item in session.items if "results" in item.fixturenames]
    prefetch(list(dict.fromkeys(files)))


def pytest_sessionfinish() -> None:
    stop_prefetch()


@pytest.fixture(scope="module")
def results(request) -> dict:
    """The requesting file's interpreted cases, from one child process (that file run as a
    module under Triton's interpreter, see interpreter.py)."""
    return interpreted_reports(request.module.__file__)
