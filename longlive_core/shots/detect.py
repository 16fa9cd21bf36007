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
    downscale: int = 0  # frames shrink by this factor for detection; 0: to 256 px on the longer side
    min_shot_s: float = 2.0  # shorter shots are rejected
    max_shot_s: float = 10.0  # longer shots are split into equal pieces
    clip_crf: int = 17  # x264 quality of stored clips; 0 is lossless
    clip_preset: str = "veryfast"
    shard_max_mb: float = 1024.0  # a shard is closed (and its videos committed) past this size
    shard_min_live: float = 0.5  # a shard that lost clips is rewritten when those still used are under this share
    workers: int = 2
    executor: str = "local"  # local (processes here) | dask (params `dask`: a local or remote cluster)

    def validate(self, where: str) -> None:
        if self.detector not in ("adaptive", "content"):
            raise ConfigError(f"{where}.detector must be 'adaptive' or 'content', got {self.detector!r}")
        if not 0 < self.min_shot_s <= self.max_shot_s / 2:
            raise ConfigError(f"{where}: need 0 < min_shot_s <= max_shot_s / 2 (so split pieces stay usable), "
                              f"got {self.min_shot_s} and {self.max_shot_s}")
        if not 0 <= self.clip_crf <= 51:
            raise ConfigError(f"{where}.clip_crf must be in 0..51")
        if not 0 <= self.shard_min_live <= 1:
            raise ConfigError(f"{where}.shard_min_live must be in 0..1 (0: never rewrite a shard)")
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


def _small_bgr(frame, size: tuple[int, int]) -> np.ndarray:
    """The frame resized to ``size`` (width, height), as BGR for the detector.

    Planar YUV frames (8 to 16 bits, any chroma subsampling, and NV12/NV21/P010) are sampled
    straight from the decoder's planes (nearest pixel) and converted at the small size: converting
    and scaling the full frame costs more than decoding it (bench/RESULTS.md). Other pixel formats
    go through swscale at the small size.
    """
    fmt = frame.format
    comps = fmt.components
    bits = comps[0].bits
    planes = frame.planes
    three = len(planes) == 3 and len(comps) == 3
    semi = len(planes) == 2 and fmt.name in ("nv12", "nv21", "p010le", "p012le", "p016le")
    if fmt.is_rgb or fmt.is_big_endian or not fmt.is_planar or bits > 16 or not (three or semi):
        return frame.reformat(width=size[0], height=size[1], format="bgr24").to_ndarray()
    dtype, nbytes = (np.uint8, 1) if bits == 8 else (np.dtype("<u2"), 2)

    def sample(plane, channels=1):
        a = np.frombuffer(plane, dtype).reshape(plane.height, plane.line_size // (nbytes * channels), channels)
        return cv2.resize(a[:, : plane.width], size, interpolation=cv2.INTER_NEAREST)

    if three:
        y, u, v = (sample(p) for p in planes)
        shift = bits - 8
    else:  # interleaved chroma; P010-style samples sit in the high bits
        y, uv = sample(planes[0]), sample(planes[1], 2)
        u, v = (uv[..., 1], uv[..., 0]) if fmt.name == "nv21" else (uv[..., 0], uv[..., 1])
        shift = 0 if bits == 8 else 8
    if shift:
        y, u, v = ((c >> shift).astype(np.uint8) for c in (y, u, v))
    # YCbCr -> BGR with the matrix and range swscale would use (as the plain call's conversion does):
    # BT.709 or BT.2020 where the frame says so, else BT.601; full range for yuvj* or where flagged.
    kr, kb = {1: (0.2126, 0.0722), 9: (0.2627, 0.0593), 10: (0.2627, 0.0593)}.get(frame.colorspace, (0.299, 0.114))
    full = fmt.name.startswith("yuvj") or frame.color_range == 2
    ys, cs, y0 = (1.0, 1.0, 0.0) if full else (255 / 219, 255 / 224, 16.0)
    bu, rv = 2 * (1 - kb) * cs, 2 * (1 - kr) * cs  # B from Cb, R from Cr
    gu, gv = -bu * kb / (1 - kr - kb), -rv * kr / (1 - kr - kb)  # G from both
    m = np.array([[ys, bu, 0.0, -ys * y0 - bu * 128], [ys, gu, gv, -ys * y0 - (gu + gv) * 128],
                  [ys, 0.0, rv, -ys * y0 - rv * 128]], np.float32)
    return cv2.transform(cv2.merge([y, u, v]), m)


@dataclasses.dataclass(frozen=True)
class Detection:
    cuts: list[int]  # decoded-frame index of the first frame of every shot but the first
    times: list[float]  # every decoded frame's time in seconds, relative to the first frame


def detect_cuts(path: str | Path, cfg: ShotsConfig, fps: float) -> Detection:
    """Runs PySceneDetect's detector on every decoded frame, shrunk to 256 px on its longer side (as
    ``scenedetect.detect`` shrinks it; or by ``cfg.downscale``) straight from the decoder's planes,
    with in-loop deblocking skipped: neither changes what a 256-px colour-difference detector sees,
    and together they make detection about 1.6x cheaper than ``scenedetect.detect`` on a mix of
    codecs and containers, with the same cuts (bench/shots_throughput.py).
    ``fps`` is the rate ingest measured, so time-based detector settings mean the same everywhere.
    Frame times come from the frames' own timestamps (a stream may start late or change rate).
    """
    from scenedetect import FrameTimecode

    detector = make_detector(cfg)
    cuts = []
    times: list[float] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        ctx = stream.codec_context
        w, h = ctx.width, ctx.height

        def target(w: int, h: int) -> tuple[int, int]:
            """The plain call's frame size: 256 px on the longer side (scenedetect's auto downscale);
            or the frame shrunk by cfg.downscale."""
            if cfg.downscale:
                return max(1, w // cfg.downscale), max(1, h // cfg.downscale)
            k = max(w, h, 256) / 256
            return max(1, round(w / k)), max(1, round(h / k))

        size = target(w, h) if w and h else None
        # Decoder options that leave every frame and its timestamp as a full decode gives them
        # (bench/RESULTS.md, mixed codecs): deblocking off (H.264, HEVC, VP8, VP9), and one thread
        # (the stage runs a process per core; slice threads add CPU time, not speed). FFmpeg's
        # "lowres" (MPEG-2, MPEG-4 Part 2, MJPEG at 1/4 or 1/8 size) was faster still but smooths
        # what the detector sees by 6-10% at a cut, so cuts near a threshold could move: not used.
        ctx.options = {"skip_loop_filter": "all"}
        ctx.thread_count = 1
        for frame in container.decode(stream):
            index = len(times)
            times.append(frame_time(frame, times, fps))
            size = size or target(frame.width, frame.height)
            cuts += detector.process_frame(FrameTimecode(index, fps), _small_bgr(frame, size))
        cuts += detector.post_process(FrameTimecode(len(times), fps))
    t0 = times[0] if times else 0.0
    return Detection(sorted({c.frame_num for c in cuts if 0 < c.frame_num < len(times)}), [t - t0 for t in times])


def frame_time(frame: av.VideoFrame, earlier: list[float], fps: float) -> float:
    """The frame's presentation time; a frame without one (some AVI decoders) follows the last by 1/fps."""
    if frame.time is not None:
        return float(frame.time)
    return earlier[-1] + 1.0 / fps if earlier else 0.0
