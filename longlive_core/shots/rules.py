"""Shot-length rules: which detected shots are usable training clips.

Shots longer than the maximum are split into equal pieces no longer than the maximum (equal
pieces, so no short remainder is wasted); shots shorter than the minimum are rejected. With
min <= max / 2 every piece of a split shot is long enough.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Piece:
    start_frame: int
    end_frame: int  # exclusive
    reason: str | None  # None: usable
    scene_index: int = 0  # the detected shot it comes from (several pieces when split)

    @property
    def num_frames(self) -> int:
        return self.end_frame - self.start_frame


def shots_from_cuts(num_frames: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans from cut frames (each cut is the first frame of a new shot)."""
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < num_frames), num_frames]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def apply_length_rules(spans: list[tuple[int, int]], min_frames: int, max_frames: int) -> list[Piece]:
    if not 1 <= min_frames <= max_frames // 2:
        raise ValueError(f"need 1 <= min_frames <= max_frames / 2, got {min_frames} and {max_frames}")
    out: list[Piece] = []
    for scene, (start, end) in enumerate(spans):
        length = end - start
        if length < min_frames:
            out.append(Piece(start, end, f"too short: {length} frames < {min_frames}", scene))
            continue
        n = math.ceil(length / max_frames)
        edges = [start + (length * i) // n for i in range(n + 1)]
        out.extend(Piece(a, b, None, scene) for a, b in zip(edges, edges[1:]))
    return out
