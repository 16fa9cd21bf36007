"""Synthetic multi-shot videos for the demo and the tests.

Each shot has its own background (a hue gradient far from its neighbours' hues), a fixed texture
and shapes that move across it, so a shot detector sees a hard cut at every shot boundary and
steady motion inside a shot. Encoded as real files with PyAV: H.264 in MP4 by default, or any codec
and container FFmpeg writes.
"""
from __future__ import annotations

import colorsys
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

from longlive_core.video.writer import VideoWriter


@dataclasses.dataclass(frozen=True)
class ShotSpec:
    num_frames: int
    hue: float  # 0..1, background hue
    shape: str  # "circle" or "square"
    seed: int
    moving: bool = True  # False: nothing moves (a static shot, for the motion filter)


@dataclasses.dataclass(frozen=True)
class VideoSpec:
    relpath: str
    shots: tuple[ShotSpec, ...]

    @property
    def num_frames(self) -> int:
        return sum(s.num_frames for s in self.shots)

    @property
    def cut_frames(self) -> list[int]:
        """Decoded-frame index at which each shot after the first begins."""
        cuts, pos = [], 0
        for shot in self.shots[:-1]:
            pos += shot.num_frames
            cuts.append(pos)
        return cuts


def _rgb(hue: float, sat: float, val: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(hue % 1.0, sat, val), dtype=np.float32) * 255.0


def render_shot(shot: ShotSpec, width: int, height: int) -> Iterator[np.ndarray]:
    """Yields ``shot.num_frames`` RGB uint8 frames of shape (height, width, 3)."""
    rng = np.random.default_rng(shot.seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    top, bottom = _rgb(shot.hue, 0.8, 0.95), _rgb(shot.hue + 0.08, 0.9, 0.45)
    t = (yy / max(height - 1, 1))[..., None]
    background = top * (1 - t) + bottom * t
    background += rng.normal(0.0, 10.0, size=(height, width, 1)).astype(np.float32)  # texture
    size = 0.12 * min(width, height) + rng.uniform(0, 0.06) * min(width, height)
    color = _rgb(shot.hue + 0.5, 0.9, 1.0)
    x0, y0 = rng.uniform(0.2, 0.8) * width, rng.uniform(0.2, 0.8) * height
    vx, vy = rng.uniform(-1, 1, size=2) * 0.012 * np.array([width, height]) * float(shot.moving)
    x2, y2 = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    color2 = _rgb(shot.hue + 0.3, 0.6, 0.3)
    for i in range(shot.num_frames):
        frame = background.copy()
        cx = (x0 + vx * i) % width
        cy = (y0 + vy * i) % height
        if shot.shape == "circle":
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= size**2
        else:
            mask = (np.abs(xx - cx) <= size) & (np.abs(yy - cy) <= size)
        frame[mask] = color
        # a second, slower shape moving the other way keeps the motion non-trivial
        mask2 = (np.abs(xx - (x2 - 0.5 * vx * i) % width) <= size * 0.6) & (np.abs(yy - y2) <= size * 0.4)
        frame[mask2] = color2
        yield np.clip(frame, 0, 255).astype(np.uint8)


def encode_frames(path: str | Path, frames: Iterable[np.ndarray], fps: int, width: int, height: int,
                  crf: int = 23, rotation: int = 0, pts: Sequence[int] | None = None, container: str = "mp4",
                  codec: str = "libx264", pix_fmt: str = "yuv420p", time_base: Fraction | None = None) -> int:
    """Writes the frames as ``codec`` in a ``container`` file (``VideoWriter``); returns the frame count.
    ``pts`` gives each frame's timestamp in units of ``time_base`` (default 1/fps), so gaps make a
    variable-frame-rate file and an offset a stream that starts late."""
    with VideoWriter(path, fps, width, height, crf, rotation, container, codec, pix_fmt, time_base) as out:
        for n, rgb in enumerate(frames):
            out.write(rgb, None if pts is None else pts[n])
    return out.frames


def write_video(path: str | Path, spec: VideoSpec, fps: int, width: int, height: int, crf: int = 23,
                **encoding) -> int:
    """``encoding``: ``encode_frames``'s container, codec, pix_fmt, pts and time_base."""
    frames = (f for shot in spec.shots for f in render_shot(shot, width, height))
    return encode_frames(path, frames, fps, width, height, crf, **encoding)
