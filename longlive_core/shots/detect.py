"""Shot boundaries with PySceneDetect (PyAV backend), as decoded-frame indices."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from longlive_core.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ShotsConfig:
    detector: str = "adaptive"  # adaptive | content
    adaptive_threshold: float = 3.0
    window_width: int = 2
    min_content_val: float = 15.0
    content_threshold: float = 27.0
    min_scene_len: int = 15  # frames between two cuts, the detector's own rule
    downscale: int = 0  # 0: PySceneDetect picks a factor for about 256 px wide
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

    def detection_key(self) -> dict:
        """The params whose change invalidates earlier detections and clips."""
        keep = ("detector", "adaptive_threshold", "window_width", "min_content_val", "content_threshold",
                "min_scene_len", "downscale", "min_shot_s", "max_shot_s", "clip_crf", "clip_preset")
        return {k: getattr(self, k) for k in keep}


def make_detector(cfg: ShotsConfig):
    from scenedetect import AdaptiveDetector, ContentDetector

    if cfg.detector == "adaptive":
        return AdaptiveDetector(adaptive_threshold=cfg.adaptive_threshold, min_scene_len=cfg.min_scene_len,
                                window_width=cfg.window_width, min_content_val=cfg.min_content_val)
    return ContentDetector(threshold=cfg.content_threshold, min_scene_len=cfg.min_scene_len)


def detect_cuts(path: str | Path, cfg: ShotsConfig) -> list[int]:
    """Decoded-frame index of the first frame of every shot but the first; [] for one shot."""
    from scenedetect import SceneManager, open_video

    video = open_video(str(path), backend="pyav")
    manager = SceneManager()
    manager.add_detector(make_detector(cfg))
    if cfg.downscale:
        manager.auto_downscale = False
        manager.downscale = cfg.downscale
    manager.detect_scenes(video=video)
    return [start.frame_num for start, _ in manager.get_scene_list()[1:]]
