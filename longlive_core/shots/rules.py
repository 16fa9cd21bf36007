"""Shot-length rules: which detected shots are usable training clips.

Shots longer than the maximum are split into equal pieces no longer than the maximum (equal
pieces, so no short remainder is wasted); shots shorter than the minimum are rejected. With
min <= max / 2 every piece of a split shot is long enough (to within a frame). Lengths are the
frames' own timestamps, as the clips keep them and the latent stage resamples by them.
"""
from __future__ import annotations

import bisect
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


_EPS = 1e-6  # seconds: container timestamps are rounded to their time base


def apply_length_rules(spans: list[tuple[int, int]], bounds: list[float], min_s: float, max_s: float) -> list[Piece]:
    """``bounds``: each frame's start time, then the end of the last frame (one more than the frames).
    Lengths are times, not frame counts, so a variable-frame-rate source is judged by what it shows;
    a long shot is cut at the frames nearest its equal-time split points."""
    if not 0 < min_s <= max_s / 2:
        raise ValueError(f"need 0 < min_s <= max_s / 2, got {min_s} and {max_s}")
    out: list[Piece] = []
    for scene, (start, end) in enumerate(spans):
        duration = bounds[end] - bounds[start]
        if duration < min_s - _EPS:
            out.append(Piece(start, end, f"too short: {end - start} frames, {duration:.3f} s < {min_s:g} s", scene))
            continue
        n = math.ceil(duration / max_s - _EPS)
        while True:  # frame granularity can leave a piece a fraction of a frame over the maximum
            edges = [start, *(_nearest_frame(bounds, start, end, bounds[start] + duration * i / n)
                              for i in range(1, n)), end]
            if all(bounds[b] - bounds[a] <= max_s + _EPS for a, b in zip(edges, edges[1:])):
                break
            n += 1
        out.extend(Piece(a, b, None, scene) for a, b in zip(edges, edges[1:]) if b > a)
    return out


def _nearest_frame(bounds: list[float], start: int, end: int, t: float) -> int:
    """The frame in (start, end) whose start time is nearest t (the earlier on a tie)."""
    j = min(max(bisect.bisect_left(bounds, t, start + 1, end), start + 1), end - 1)
    return j - 1 if j - 1 > start and t - bounds[j - 1] <= bounds[j] - t else j
