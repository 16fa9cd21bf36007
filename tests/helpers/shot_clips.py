"""Shots made in a test, stored as the `shots` stage stores them (H.264 clips in a tar shard, rows of
shots.parquet's columns), for the iqa_filter tests that need content of their own: fades, copies."""
from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np
import pandas as pd

from longlive_core.shots.clips import ShardWriter
from longlive_core.shots.split import SHOT_COLUMNS
from longlive_core.video.synth import encode_frames

FPS = 24


def write_shots(root: Path, videos: dict[str, list[list[np.ndarray]]], crf: int = 18) -> tuple[pd.DataFrame, Path]:
    """``videos``: path -> its shots' RGB frames. Returns (shots, clips directory)."""
    clips, work = root / "clips", root / "encode"
    work.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(clips, 1 << 30)
    rows = []
    for path, shots in videos.items():
        video_id = hashlib.sha256(path.encode()).hexdigest()[:16]
        start = 0
        for index, frames in enumerate(shots):
            h, w = frames[0].shape[:2]
            mp4 = work / f"{video_id}-{index}.mp4"
            encode_frames(mp4, frames, FPS, w, h, crf=crf)
            data = mp4.read_bytes()
            member = f"{video_id}/{index:04d}.mp4"
            rows.append({"video_id": video_id, "shot_index": index, "scene_index": index, "start_frame": start,
                         "end_frame": start + len(frames), "start_s": start / FPS,
                         "end_s": (start + len(frames)) / FPS, "duration_s": len(frames) / FPS,
                         "num_frames": len(frames), "fps": float(FPS), "path": path,
                         "clip_shard": writer.add(member, data), "clip_member": member,
                         "clip_sha256": hashlib.sha256(data).hexdigest()})
            start += len(frames)
    writer.close()
    return pd.DataFrame(rows, columns=SHOT_COLUMNS), clips


def scene(seed: int, frames: int = 16, width: int = 192, height: int = 112) -> list[np.ndarray]:
    """A camera panning over a random field with natural images' 1/f spectrum (so a perceptual hash
    sees what it sees in footage, not a few flat shapes)."""
    rng = np.random.default_rng(seed)
    h, w = height, width + 3 * frames
    f = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :])
    f[0, 0] = 1.0
    spectrum = (rng.normal(size=(3, *f.shape)) + 1j * rng.normal(size=(3, *f.shape))) / f
    spectrum[:, 0, 0] = 0
    field = np.moveaxis(np.fft.irfft2(spectrum, s=(h, w)), 0, -1)
    field = np.clip((field - field.mean()) / field.std() * 45 + 120, 0, 255).astype(np.uint8)
    return [np.ascontiguousarray(field[:, 3 * k:3 * k + width]) for k in range(frames)]


def jpeg(frame: np.ndarray, quality: int) -> np.ndarray:
    ok, buf = cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)


def crop(frame: np.ndarray, left: float, top: float, right: float, bottom: float) -> np.ndarray:
    """The frame less at most those fractions of its width and height on each side, to an even size
    (as H.264 in 4:2:0 needs) by cutting a pixel less where a side is cut."""
    h, w = frame.shape[:2]
    y0, x0, y1, x1 = int(top * h), int(left * w), h - int(bottom * h), w - int(right * w)
    if (y1 - y0) % 2:
        y0, y1 = (y0 - 1, y1) if y0 else (y0, y1 + 1) if y1 < h else (y0, y1 - 1)
    if (x1 - x0) % 2:
        x0, x1 = (x0 - 1, x1) if x0 else (x0, x1 + 1) if x1 < w else (x0, x1 - 1)
    return np.ascontiguousarray(frame[y0:y1, x0:x1])


def rescale(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    return cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA)
