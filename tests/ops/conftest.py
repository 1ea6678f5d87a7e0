"""Fixtures of the op tests."""

import pytest

from tests.ops.interpreter import interpreted_reports


@pytest.fixture(scope="module")
def results(request) -> dict:
    """The requesting file's interpreted cases, from one child process (that file run as a
    module under Triton's interpreter, see interpreter.py)."""
    return interpreted_reports(request.module.__file__)
