"""Per-item functions for the Dask executor tests (top level, so spawned workers can import them)."""
from __future__ import annotations

import math
import os
from pathlib import Path


def root(x: float) -> float:
    return math.sqrt(x)


def die_once(item: tuple[str, int]) -> int:
    """Kills its worker process the first time it sees item 2; returns x * 10 otherwise."""
    marker, x = item
    if x == 2 and not Path(marker).exists():
        Path(marker).touch()
        os._exit(1)
    return x * 10


def always_die(x: int) -> int:
    if x == 1:
        os._exit(1)
    return x
