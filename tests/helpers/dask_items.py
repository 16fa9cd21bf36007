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


def slot_after_a_nap(_: int) -> int:
    """The worker's slot, after long enough that every worker gets items."""
    import time

    from longlive_core.parallel import worker_slot

    time.sleep(0.2)
    return worker_slot()
