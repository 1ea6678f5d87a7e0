"""Shared by the vision tests: the debug vision config, the committed tokenizer, tiny images."""

from pathlib import Path

import pytest
import torch

from titan_moe.data.tokenizer import TitanTokenizer, asset_path
from titan_moe.model.args import VISION_FLAVORS, VisionArgs


@pytest.fixture
def vision() -> VisionArgs:
    return VisionArgs(**{**VISION_FLAVORS["debug"].__dict__}).validate()


@pytest.fixture(scope="session")
def tokenizer() -> TitanTokenizer:
    return TitanTokenizer(asset_path(4096))


def write_png(path: Path, height: int, width: int, seed: int = 0) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


@pytest.fixture
def scalars_of():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(run_dir: Path, tag: str) -> list[tuple[int, float]]:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        return [(s.step, s.value) for s in events.Scalars(tag)]

    return read
