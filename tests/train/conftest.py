"""Shared by the training tests: read a tag's scalars back from a run's TensorBoard folder."""

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one TensorBoard run's scalar `tag`."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(s.step, s.value) for s in events.Scalars(tag)]


@pytest.fixture
def scalars_of():
    return read_scalars
