"""Brings a shot's frames to the training format: display rotation applied, any pixel format to
8-bit RGB, resampled by timestamps to a fixed frame rate, resized with centre crop or padding, and
trimmed to 1 + 4k frames (the VAE's temporal stride). What was changed is counted.

Resampling takes, for each output time t0 + k / fps, the last source frame shown at that time, so a
variable-frame-rate clip plays at its real speed; source frames that no output time lands on are
counted as dropped, those used twice as repeated.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import cv2
import numpy as np

from longlive_core.config import ConfigError

FITS = ("crop", "pad")
PORTRAIT = ("fit", "drop")


@dataclasses.dataclass(frozen=True)
class ClipFormat:
    fps: float = 24.0
    height: int = 704
    width: int = 1280
    fit: str = "crop"  # crop: fill the frame and cut the overhang; pad: fit inside, black bars
    portrait: str = "fit"  # fit: like any other shape; drop: refuse portrait shots
    temporal_stride: int = 4

    def validate(self, where: str) -> None:
        if self.fit not in FITS:
            raise ConfigError(f"{where}.fit must be one of {FITS}; got {self.fit!r}")
        if self.portrait not in PORTRAIT:
            raise ConfigError(f"{where}.portrait must be one of {PORTRAIT}; got {self.portrait!r}")
        if self.fps <= 0 or self.height <= 0 or self.width <= 0 or self.temporal_stride <= 0:
            raise ConfigError(f"{where}: fps, height, width and temporal_stride must be positive")


class ClipRejected(ValueError):
    """A clip the format cannot take (too short once resampled, portrait when portrait is 'drop')."""


@dataclasses.dataclass
class NormalizedClip:
    frames: np.ndarray  # (T, height, width, 3) uint8, T = 1 + stride * k
    counts: dict[str, int]


def rotate(rgb: np.ndarray, rotation: int) -> np.ndarray:
    """The frame as displayed: FFmpeg's display matrix angle turns the stored frame counterclockwise."""
    k = (rotation // 90) % 4
    if rotation % 90:
        raise ValueError(f"display rotation {rotation} is not a multiple of 90 degrees")
    return np.ascontiguousarray(np.rot90(rgb, k)) if k else rgb


def fit_frame(rgb: np.ndarray, height: int, width: int, fit: str) -> np.ndarray:
    h, w = rgb.shape[:2]
    scale = max(height / h, width / w) if fit == "crop" else min(height / h, width / w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
    resized = cv2.resize(rgb, (nw, nh), interpolation=interp) if (nh, nw) != (h, w) else rgb
    if fit == "crop":
        top, left = (nh - height) // 2, (nw - width) // 2
        return np.ascontiguousarray(resized[top:top + height, left:left + width])
    out = np.zeros((height, width, 3), dtype=np.uint8)
    top, left = (height - nh) // 2, (width - nw) // 2
    out[top:top + nh, left:left + nw] = resized
    return out


def resample_indices(times: np.ndarray, fps: float) -> np.ndarray:
    """Source index shown at each output time t0 + k / fps, over the clip's span (its last frame
    lasting one median frame interval). The definition ``normalize_clip`` follows while streaming."""
    times = np.asarray(times, dtype=np.float64)
    n_out = _output_frames(times, fps)
    out_times = times[0] + np.arange(n_out) / fps
    return np.clip(np.searchsorted(times, out_times + 1e-9, side="right") - 1, 0, len(times) - 1)


def _output_frames(times: np.ndarray, fps: float) -> int:
    last = times[-1] + (np.median(np.diff(times)) if len(times) > 1 else 1.0 / fps)
    return max(1, int(np.floor((last - times[0]) * fps + 1e-6)))


def normalize_clip(frames: Iterable[tuple[np.ndarray, float, int]], fmt: ClipFormat) -> NormalizedClip:
    """frames: (stored RGB uint8, time s, display rotation) as ``shots.clips.iter_timed_frames`` gives.

    Streams: each source frame is fitted to the output size as soon as the next frame's time shows
    which output times it covers, so memory holds output-sized frames, not the source's."""
    times: list[float] = []
    slots: list[int] = []  # source index of each output frame so far
    fitted: dict[int, np.ndarray] = {}  # output-sized frame per source index some slot uses
    previous = None
    rotation = portrait = None
    for i, (rgb, t, rot) in enumerate(frames):
        if rotation is None:
            rotation = rot
            h, w = rgb.shape[:2]
            if rotation % 180:
                h, w = w, h
            portrait = h > w
            if portrait and fmt.portrait == "drop":
                raise ClipRejected(f"portrait ({w}x{h} as displayed) and clip format portrait is 'drop'")
        elif rot != rotation:
            raise ClipRejected(f"display rotation changes within the clip ({rotation} then {rot} at frame {i})")
        if times and t < times[-1]:
            raise ClipRejected(f"frame times go backwards at frame {i} ({times[-1]:.6f} s then {t:.6f} s)")
        if previous is not None:
            _assign(slots, fitted, i - 1, previous, times[0], t, None, rotation, fmt)
        times.append(float(t))
        previous = rgb
    if previous is None:
        raise ClipRejected("no frames decoded")
    n_out = _output_frames(np.array(times), fmt.fps)
    del slots[n_out:]
    _assign(slots, fitted, len(times) - 1, previous, times[0], math.inf, n_out, rotation, fmt)
    if n_out < 1 + fmt.temporal_stride:
        raise ClipRejected(f"{n_out} frames at {fmt.fps} fps; at least {1 + fmt.temporal_stride} needed")
    keep = 1 + fmt.temporal_stride * ((n_out - 1) // fmt.temporal_stride)
    out = np.stack([fitted[i] for i in slots[:keep]])
    distinct = len(set(slots))
    counts = {
        "source_frames": len(times),
        "resampled_frames": n_out,
        "frames": keep,
        "trimmed_frames": n_out - keep,
        "dropped_source_frames": len(times) - distinct,
        "repeated_frames": n_out - distinct,
        "rotated": int(rotation != 0),
        "portrait": int(portrait),
    }
    return NormalizedClip(out, counts)


def _assign(slots: list[int], fitted: dict, source: int, rgb: np.ndarray, t0: float, next_time: float,
            limit: int | None, rotation: int, fmt: ClipFormat) -> None:
    """Gives ``source`` every next output slot k shown before ``next_time`` (the next source frame's
    time), up to ``limit`` slots in all; fits the frame once."""
    while (limit is None or len(slots) < limit) and t0 + len(slots) / fmt.fps + 1e-9 < next_time:
        if source not in fitted:
            fitted[source] = fit_frame(rotate(rgb, rotation), fmt.height, fmt.width, fmt.fit)
        slots.append(source)
