"""argparse types for numbers with a range, so a value outside it is argparse's one line
`error: argument --iters: must be >= 1, got 0` and exit 2 rather than a failure mid-run."""

import argparse
import math
from collections.abc import Callable


def in_range(kind: type, low: float, high: float = math.inf,
             open_low: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: `kind(text)` in [low, high], or (low, high] when open_low."""
    if high == math.inf:
        allowed = f"> {low}" if open_low else f">= {low}"
    else:
        allowed = f"in {'(' if open_low else '['}{low}, {high}]"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        # Written so that nan fails too.
        if not ((value > low if open_low else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


positive = in_range(int, 1)
non_negative = in_range(int, 0)
positive_float = in_range(float, 0, open_low=True)


def positive_ints(text: str) -> list[int]:
    """An argparse `type=`: a comma-separated list of ints, each >= 1."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return [positive(x) for x in items]
