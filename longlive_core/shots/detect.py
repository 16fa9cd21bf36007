"""Shot boundaries as decoded-frame indices: PySceneDetect's detectors fed by a PyAV decode loop."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import av
import cv2
import numpy as np

from longlive_core.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ShotsConfig:
    detector: str = "adaptive"  # adaptive | content
    adaptive_threshold: float = 3.0
    window_width: int = 2
    min_content_val: float = 15.0
    content_threshold: float = 27.0
    min_scene_len: int = 15  # frames between two cuts, the detector's own rule
    downscale: int = 0  # frames shrink by this factor for detection; 0: to about 256 px wide
    min_shot_s: float = 2.0  # shorter shots are rejected
    max_shot_s: float = 10.0  # longer shots are split into equal pieces
    clip_crf: int = 17  # x264 quality of stored clips; 0 is lossless
    clip_preset: str = "veryfast"
    shard_max_mb: float = 1024.0  # a shard is closed (and its videos committed) past this size
    workers: int = 2
    executor: str = "local"

    def validate(self, where: str) -> None:
        if self.detector not in ("adaptive", "content"):
            raise ConfigError(f"{where}.detector must be 'adaptive' or 'content', got {self.detector!r}")
        if not 0 < self.min_shot_s <= self.max_shot_s / 2:
            raise ConfigError(f"{where}: need 0 < min_shot_s <= max_shot_s / 2 (so split pieces stay usable), "
                              f"got {self.min_shot_s} and {self.max_shot_s}")
        if not 0 <= self.clip_crf <= 51:
            raise ConfigError(f"{where}.clip_crf must be in 0..51")
        if self.workers < 1 or self.shard_max_mb <= 0 or self.min_scene_len < 1 or self.downscale < 0:
            raise ConfigError(f"{where}: workers and min_scene_len must be >= 1, shard_max_mb > 0, downscale >= 0")

    def result_params(self) -> dict:
        """The params earlier detections and clips depend on (not workers, executor or shard sizes)."""
        keep = ("detector", "adaptive_threshold", "window_width", "min_content_val", "content_threshold",
                "min_scene_len", "downscale", "min_shot_s", "max_shot_s", "clip_crf", "clip_preset")
        return {k: getattr(self, k) for k in keep}


def make_detector(cfg: ShotsConfig):
    from scenedetect import AdaptiveDetector, ContentDetector

    if cfg.detector == "adaptive":
        return AdaptiveDetector(adaptive_threshold=cfg.adaptive_threshold, min_scene_len=cfg.min_scene_len,
                                window_width=cfg.window_width, min_content_val=cfg.min_content_val)
    return ContentDetector(threshold=cfg.content_threshold, min_scene_len=cfg.min_scene_len)


def _small_bgr(frame, step: int) -> np.ndarray:
    """The frame shrunk by ``step`` in each direction, as BGR for the detector.

    For 8-bit 4:2:0 frames the planes are subsampled in place and converted at the small size:
    converting and scaling the full frame costs more than decoding it (bench/RESULTS.md). Other
    pixel formats go through swscale at the small size.
    """
    w, h = frame.width, frame.height
    sw, sh = max(1, w // step), max(1, h // step)
    if frame.format.name not in ("yuv420p", "yuvj420p") or step < 2:
        return frame.reformat(width=sw, height=sh, format="bgr24").to_ndarray()
    y, u, v = (np.frombuffer(p, np.uint8).reshape(p.height, p.line_size) for p in frame.planes)
    ys = np.ascontiguousarray(y[: sh * step : step, : sw * step : step])
    half = max(1, step // 2)
    us = cv2.resize(u[: h // 2 : half, : w // 2 : half], (sw, sh), interpolation=cv2.INTER_NEAREST)
    vs = cv2.resize(v[: h // 2 : half, : w // 2 : half], (sw, sh), interpolation=cv2.INTER_NEAREST)
    return cv2.cvtColor(cv2.merge([ys, vs, us]), cv2.COLOR_YCrCb2BGR)


@dataclasses.dataclass(frozen=True)
class Detection:
    cuts: list[int]  # decoded-frame index of the first frame of every shot but the first
    times: list[float]  # every decoded frame's time in seconds, relative to the first frame


def detect_cuts(path: str | Path, cfg: ShotsConfig, fps: float) -> Detection:
    """Runs PySceneDetect's detector on every decoded frame, shrunk to about 256 px wide (or by
    ``cfg.downscale``) straight from the decoder's planes, with H.264's deblocking filter skipped:
    neither changes what a 256-px colour-difference detector sees, and together they make
    detection about 1.7x cheaper than ``scenedetect.detect`` (bench/shots_throughput.py).
    ``fps`` is the rate ingest measured, so time-based detector settings mean the same everywhere.
    Frame times come from the frames' own timestamps (a stream may start late or change rate).
    """
    from scenedetect import FrameTimecode

    detector = make_detector(cfg)
    cuts = []
    times: list[float] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.options = {"skip_loop_filter": "all"}
        width = stream.codec_context.width
        step = cfg.downscale or max(1, width // 256)
        for frame in container.decode(stream):
            index = len(times)
            times.append(frame_time(frame, times, fps))
            cuts += detector.process_frame(FrameTimecode(index, fps), _small_bgr(frame, step))
        cuts += detector.post_process(FrameTimecode(len(times), fps))
    t0 = times[0] if times else 0.0
    return Detection(sorted({c.frame_num for c in cuts if 0 < c.frame_num < len(times)}), [t - t0 for t in times])


def frame_time(frame: av.VideoFrame, earlier: list[float], fps: float) -> float:
    """The frame's presentation time; a frame without one (some AVI decoders) follows the last by 1/fps."""
    if frame.time is not None:
        return float(frame.time)
    return earlier[-1] + 1.0 / fps if earlier else 0.0
