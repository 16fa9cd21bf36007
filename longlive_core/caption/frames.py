"""A shot's frames for the caption model, sampled by time from its clip."""
from __future__ import annotations

import numpy as np

from longlive_core.shots.clips import iter_timed_frames
from longlive_core.video.normalize import rotate


def sample_times(duration_s: float, fps: float, max_frames: int) -> list[float]:
    """Times (from the shot's first frame) at ``fps``, at most ``max_frames`` spread over the shot, and an
    even count of at least two: Qwen2.5-VL reads frames in pairs."""
    n = max(1, int(np.floor(duration_s * fps + 1e-9)))
    times = [i / fps for i in range(n)] if n <= max_frames else \
        list(np.linspace(0.0, duration_s, max_frames, endpoint=False))
    if len(times) % 2:
        times = times[:-1] if len(times) > 2 and len(times) == max_frames else times + [times[-1]]
    return [float(t) for t in times]


def shot_frames(clip: bytes, duration_s: float, fps: float, max_frames: int) -> np.ndarray:
    """(T, H, W, 3) uint8 frames as displayed: for each sampled time, the last frame shown at it."""
    wanted = sample_times(duration_s, fps, max_frames)
    picked: list[np.ndarray] = []
    t0, last = None, None
    for rgb, t, rotation in iter_timed_frames(clip):
        t0 = t if t0 is None else t0
        while len(picked) < len(wanted) and t - t0 > wanted[len(picked)] + 1e-6:
            picked.append(last)  # the frame shown at that time is the previous one
        if len(picked) == len(wanted):
            break
        last = rotate(rgb, rotation)
    if last is None:
        raise ValueError("the clip has no frame")
    picked += [last] * (len(wanted) - len(picked))
    return np.stack(picked)
