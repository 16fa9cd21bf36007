"""The demo's raw data: real H.264 files with known cuts, caption sidecars, and one bad file of
each kind that ingest must handle (truncated, empty, not a video, a byte-identical copy, too
short). Deterministic for a given seed."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from longlive_core.config import ConfigError
from longlive_core.io.atomic import write_bytes, write_json
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video


@dataclasses.dataclass(frozen=True)
class DemoDataConfig:
    enabled: bool = True
    seed: int = 0
    num_videos: int = 5  # good videos; at least 5, so each kind of video below is present
    width: int = 320
    height: int = 192
    fps: int = 24
    min_shots: int = 2
    max_shots: int = 4
    shot_seconds_min: float = 1.0
    shot_seconds_max: float = 2.5
    short_shot_frames: int = 6  # one video holds a shot this short, for the shot-length rules
    crf: int = 23

    def validate(self, where: str) -> None:
        if self.num_videos < 5:
            raise ConfigError(f"{where}.num_videos must be >= 5 (one of each demo case), got {self.num_videos}")
        if self.width % 16 or self.height % 16:
            raise ConfigError(f"{where}: width and height must be multiples of 16 (H.264 macroblocks)")
        if not 1 <= self.min_shots <= self.max_shots:
            raise ConfigError(f"{where}: need 1 <= min_shots <= max_shots")
        if not 0 < self.shot_seconds_min <= self.shot_seconds_max:
            raise ConfigError(f"{where}: need 0 < shot_seconds_min <= shot_seconds_max")


# name, forced number of shots (None: random), caption form
_CASES = [
    ("street/market_day.mp4", None, "shots"),
    ("city night/café scène.mp4", 2, "whole"),  # a space and non-ASCII characters in the path
    ("nature/single_take.mp4", 1, "whole"),  # no cut at all
    ("nature/forest_walk.mp4", 4, "shots"),  # holds the too-short shot, and ends on a static one
    ("sports/match.mp4", None, "none"),  # no sidecar
]
_HUE_NAMES = ["red", "orange", "yellow", "green", "teal", "blue", "purple", "pink"]


def _hue_name(hue: float) -> str:
    return _HUE_NAMES[int((hue % 1.0) * len(_HUE_NAMES))]


def plan_demo(cfg: DemoDataConfig) -> list[tuple[VideoSpec, str]]:
    rng = np.random.default_rng(cfg.seed)
    cases = list(_CASES) + [(f"extra/clip_{i:03d}.mp4", None, "shots") for i in range(5, cfg.num_videos)]
    plans = []
    hue = float(rng.uniform())
    for vi, (name, forced, form) in enumerate(cases):
        n_shots = forced or int(rng.integers(cfg.min_shots, cfg.max_shots + 1))
        shots = []
        for si in range(n_shots):
            hue = (hue + rng.uniform(0.25, 0.75)) % 1.0  # far from the previous shot's hue
            frames = int(round(rng.uniform(cfg.shot_seconds_min, cfg.shot_seconds_max) * cfg.fps))
            if vi == 3 and si == 2:
                frames = cfg.short_shot_frames
            shape = "circle" if rng.uniform() < 0.5 else "square"
            moving = not (vi == 3 and si == 3)
            shots.append(ShotSpec(frames, float(hue), shape, int(rng.integers(2**31)), moving))
        plans.append((VideoSpec(name, tuple(shots)), form))
    return plans


def _caption(shot: ShotSpec) -> str:
    if not shot.moving:
        return f"A {_hue_name(shot.hue + 0.5)} {shot.shape} rests on a {_hue_name(shot.hue)} gradient; nothing moves."
    return (f"A {_hue_name(shot.hue + 0.5)} {shot.shape} glides over a {_hue_name(shot.hue)} gradient "
            "while a dark bar drifts the other way.")


def _sidecar(spec: VideoSpec, form: str, fps: int) -> dict[str, Any] | None:
    if form == "none":
        return None
    if form == "whole":
        return {"caption": " Then ".join(_caption(s) for s in spec.shots)}
    out, start = [], 0
    for shot in spec.shots:
        out.append({"start_s": round(start / fps, 4), "end_s": round((start + shot.num_frames) / fps, 4),
                    "caption": _caption(shot)})
        start += shot.num_frames
    return {"shots": out}


def make_demo_data(cfg: DemoDataConfig, out_dir: str | Path, truth_path: str | Path) -> dict[str, Any]:
    """Writes the demo videos under ``out_dir`` and the ground truth to ``truth_path``."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if not cfg.enabled:
        truth = {"enabled": False, "videos": [], "expected_status": {}}
        write_json(truth, truth_path)
        return truth
    videos, expected = [], {}
    plans = plan_demo(cfg)
    for spec, form in plans:
        path = out_dir / spec.relpath
        n = write_video(path, spec, cfg.fps, cfg.width, cfg.height, cfg.crf)
        assert n == spec.num_frames
        sidecar = _sidecar(spec, form, cfg.fps)
        if sidecar is not None:
            write_json(sidecar, path.with_suffix(".json"))
        start, shots = 0, []
        for shot in spec.shots:
            shots.append({"start_frame": start, "end_frame": start + shot.num_frames, "caption": _caption(shot)})
            start += shot.num_frames
        videos.append({"path": spec.relpath, "num_frames": n, "fps": cfg.fps, "cut_frames": spec.cut_frames,
                       "shots": shots, "caption_form": form,
                       "static_shots": [i for i, s in enumerate(spec.shots) if not s.moving]})
        expected[spec.relpath] = "ok"

    first = out_dir / plans[0][0].relpath
    data = first.read_bytes()
    write_bytes(data[: len(data) // 2], out_dir / "broken/truncated.mp4")
    expected["broken/truncated.mp4"] = "quarantined"
    write_bytes(b"", out_dir / "broken/empty.mp4")
    expected["broken/empty.mp4"] = "quarantined"
    write_bytes(b"Meeting notes, not a video.\n" * 20, out_dir / "broken/notes.mp4")
    expected["broken/notes.mp4"] = "quarantined"
    copy_rel = "uploads/" + Path(plans[0][0].relpath).stem + " copy.mp4"
    write_bytes(data, out_dir / copy_rel)
    expected[copy_rel] = "duplicate"
    blip = VideoSpec("short/blip.mp4", (ShotSpec(max(cfg.fps // 2, 2), 0.1, "circle", 7),))
    write_video(out_dir / blip.relpath, blip, cfg.fps, cfg.width, cfg.height, cfg.crf)
    expected[blip.relpath] = "quarantined"  # shorter than ingest.min_duration_s in the demo
    (out_dir / "README.txt").write_text("Synthetic demo videos made by the demo_data stage.\n", encoding="utf-8")

    truth = {"enabled": True, "fps": cfg.fps, "width": cfg.width, "height": cfg.height,
             "videos": videos, "expected_status": expected, "duplicate_of": {copy_rel: plans[0][0].relpath}}
    write_json(truth, truth_path)
    return truth
