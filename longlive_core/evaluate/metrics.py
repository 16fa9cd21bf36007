"""The metrics that need no weights, computed on a video as its frames stream past.

- ``temporal_flickering`` (VBench's, REFERENCE.md §5): (255 - the mean absolute difference of
  consecutive frames) / 255, over the pairs inside a shot (VBench-Long splits a video at its cuts
  before scoring; a cut is not flicker). 1 is a still image.
- ``within_shot_consistency``: for every frame after a shot's first, the intersection of its colour
  histogram (8 bins per RGB channel, normalised) with the shot's first frame's and with the previous
  frame's, averaged (VBench's subject consistency does the same with DINO features against the
  first and the previous frame). A histogram ignores where things are, so motion inside a shot
  costs little, while a shot that drifts into other colours or breaks up into noise scores lower.
- ``shot_switch``: the cuts our shot detector finds against the cuts the prompt file asked for,
  matched one to one within a tolerance in frames; accuracy = hits / (asked + unasked), so a missed
  cut and a cut where none was asked both cost.
"""
from __future__ import annotations

import dataclasses

import numpy as np

BINS = 8


def colour_histogram(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 -> (BINS^3,) float64 summing to 1."""
    index = (rgb.astype(np.int32) * BINS // 256) @ np.array([BINS * BINS, BINS, 1])
    counts = np.bincount(index.ravel(), minlength=BINS ** 3).astype(np.float64)
    return counts / counts.sum()


@dataclasses.dataclass
class ShotStats:
    """Per-shot sums, fed one frame at a time (``add``), so a long video never sits in memory."""
    frames: int = 0
    diff_sum: float = 0.0  # of consecutive frames' mean absolute difference
    pairs: int = 0
    similarity_sum: float = 0.0
    first: np.ndarray | None = None
    previous_hist: np.ndarray | None = None
    previous: np.ndarray | None = None

    def add(self, rgb: np.ndarray) -> None:
        hist = colour_histogram(rgb)
        if self.previous is not None:
            self.diff_sum += float(np.abs(rgb.astype(np.int16) - self.previous.astype(np.int16)).mean())
            self.pairs += 1
            to_first, to_previous = np.minimum(hist, self.first).sum(), np.minimum(hist, self.previous_hist).sum()
            self.similarity_sum += 0.5 * (to_first + to_previous)
        else:
            self.first = hist
        self.previous, self.previous_hist = rgb, hist
        self.frames += 1


class VideoStats:
    """The frames of one video in order, split into shots at ``shot_starts`` (frame indices)."""

    def __init__(self, shot_starts: list[int]):
        self.starts = set(shot_starts)
        self.shots: list[ShotStats] = []
        self.frames = 0

    def add(self, rgb: np.ndarray) -> None:
        if self.frames in self.starts or not self.shots:
            self.shots.append(ShotStats())
        self.shots[-1].add(rgb)
        self.frames += 1

    def temporal_flickering(self) -> float:
        pairs = sum(s.pairs for s in self.shots)
        if not pairs:
            raise ValueError("temporal flickering needs a shot of at least two frames")
        return (255.0 - sum(s.diff_sum for s in self.shots) / pairs) / 255.0

    def within_shot_consistency(self) -> float:
        pairs = sum(s.pairs for s in self.shots)
        if not pairs:
            raise ValueError("within-shot consistency needs a shot of at least two frames")
        return sum(s.similarity_sum for s in self.shots) / pairs


def shot_switch(detected: list[int], asked: list[int], tolerance: int) -> dict:
    """Greedy one-to-one matching of detected to asked cuts, nearest first, within ``tolerance`` frames."""
    pairs = sorted((abs(d - a), d, a) for d in detected for a in asked if abs(d - a) <= tolerance)
    used_d: set[int] = set()
    used_a: set[int] = set()
    for _, d, a in pairs:
        if d not in used_d and a not in used_a:
            used_d.add(d)
            used_a.add(a)
    hits = len(used_a)
    extra = len(detected) - hits
    denominator = len(asked) + extra
    return {"asked": list(asked), "detected": list(detected), "hits": hits, "missed": len(asked) - hits,
            "unasked": extra, "accuracy": hits / denominator if denominator else 1.0}
