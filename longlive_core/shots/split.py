"""Splitting ingested videos into shots: detection, length rules, clip shards, incremental state.

``split_video`` is the per-video work (pure: a path in, shots and clip bytes out) and runs in
whatever executor the stage is given. ``split_videos`` drives it over a manifest and keeps the
state that makes reruns incremental: a video is done once its clips sit in a closed shard and
its rows in ``state/``; a changed detection param (``ShotsConfig.detection_key``) redoes all.
A video that fails is reported in the rejected table and tried again on the next run.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pandas as pd

from longlive_core.data.sources import resolve_inside
from longlive_core.io.atomic import write_json, write_parquet
from longlive_core.parallel import Executor
from longlive_core.progress import Progress
from longlive_core.shots.clips import ShardWriter, cut_clips
from longlive_core.shots.detect import ShotsConfig, detect_cuts
from longlive_core.shots.rules import Piece, apply_length_rules, shots_from_cuts
from longlive_core.tracking.lineage import digest_json

log = logging.getLogger(__name__)

# scene_index: the detected shot a row comes from; rows of one scene are pieces of a long shot.
# Times are frame / fps: constant frame rate is assumed (variable rates are resampled later).
SHOT_COLUMNS = ["video_id", "shot_index", "scene_index", "start_frame", "end_frame", "start_s", "end_s",
                "duration_s", "num_frames", "fps", "path", "clip_shard", "clip_member"]
REJECT_COLUMNS = ["video_id", "path", "shot_index", "scene_index", "start_frame", "end_frame", "start_s",
                  "end_s", "duration_s", "reason"]


@dataclasses.dataclass(frozen=True)
class VideoJob:
    video_id: str
    path: str  # absolute, already checked to lie inside the source root
    relpath: str
    fps: float
    num_frames: int
    cfg: ShotsConfig


@dataclasses.dataclass
class VideoShots:
    job: VideoJob
    cuts: list[int]
    pieces: list[Piece]
    clips: dict[int, bytes]


def frame_limits(cfg: ShotsConfig, fps: float) -> tuple[int, int]:
    return max(1, math.ceil(cfg.min_shot_s * fps - 1e-9)), math.floor(cfg.max_shot_s * fps + 1e-9)


def split_video(job: VideoJob) -> VideoShots:
    cuts = detect_cuts(job.path, job.cfg, job.fps)
    min_f, max_f = frame_limits(job.cfg, job.fps)
    pieces = apply_length_rules(shots_from_cuts(job.num_frames, cuts), min_f, max_f)
    usable = {i: (p.start_frame, p.end_frame) for i, p in enumerate(pieces) if p.reason is None}
    decoded, clips = cut_clips(job.path, usable, job.fps, job.cfg.clip_crf, job.cfg.clip_preset)
    if decoded != job.num_frames:
        raise ValueError(f"decoded {decoded} frames but ingest counted {job.num_frames} packets")
    return VideoShots(job, cuts, pieces, clips)


class ShotsState:
    """Rows of every finished video, kept across runs under ``state_dir``."""

    def __init__(self, state_dir: str | Path, key: dict):
        self.dir = Path(state_dir)
        self.key = digest_json(key)
        self.rows = pd.DataFrame(columns=["video_id", "shot_index", "scene_index", "start_frame", "end_frame",
                                          "reason", "clip_shard", "clip_member"])
        meta = self.dir / "key.json"
        if meta.is_file() and json.loads(meta.read_text()).get("key") == self.key:
            if (self.dir / "pieces.parquet").is_file():
                self.rows = pd.read_parquet(self.dir / "pieces.parquet")
        elif meta.is_file():
            log.info("shots params changed since the last run: every video is split again")

    @property
    def done(self) -> set[str]:
        return set(self.rows["video_id"])

    def add(self, rows: list[dict]) -> None:
        if rows:
            self.rows = pd.concat([self.rows, pd.DataFrame(rows)], ignore_index=True)

    def save(self) -> None:
        write_parquet(self.rows, self.dir / "pieces.parquet")
        write_json({"key": self.key}, self.dir / "key.json")


@dataclasses.dataclass
class ShotsOutcome:
    shots: pd.DataFrame
    rejected: pd.DataFrame
    counts: dict[str, float]


def split_videos(manifest: pd.DataFrame, root: Path, cfg: ShotsConfig, state_dir: Path, clips_dir: Path,
                 executor: Executor) -> ShotsOutcome:
    ok = manifest[manifest["status"] == "ok"]
    state = ShotsState(state_dir, cfg.detection_key())
    todo = [VideoJob(r.video_id, str(resolve_inside(root, r.path)), r.path, float(r.fps), int(r.num_frames), cfg)
            for r in ok.itertuples(index=False) if r.video_id not in state.done]
    writer = ShardWriter(clips_dir, int(cfg.shard_max_mb * 1024 * 1024))
    pending: list[dict] = []  # rows whose clips sit in the open shard
    failed: dict[str, str] = {}
    progress = Progress(log, "shots", len(todo), "videos")
    seconds = sum(j.num_frames / j.fps for j in todo)
    try:
        for job, result in executor.map_unordered(split_video, todo):
            progress.advance()
            if isinstance(result, BaseException):
                reason = f"failed: {type(result).__name__}: {result}"
                log.warning("%s: %s", job.relpath, reason)
                failed[job.video_id] = reason
                continue
            for i, piece in enumerate(result.pieces):
                row = {"video_id": job.video_id, "shot_index": i, "scene_index": piece.scene_index,
                       "start_frame": piece.start_frame,
                       "end_frame": piece.end_frame, "reason": piece.reason, "clip_shard": None,
                       "clip_member": None}
                if piece.reason is None:
                    member = f"{job.video_id}/{i:04d}.mp4"
                    row["clip_shard"], row["clip_member"] = writer.add(member, result.clips[i]), member
                pending.append(row)
            if writer.full:
                writer.close()
                state.add(pending)
                pending = []
                state.save()
    finally:
        # Only rows whose shard is closed become state; a killed run redoes the open shard's videos.
        writer.close()
        state.add(pending)
        state.save()

    meta = ok.set_index("video_id")[["path", "fps"]]
    live = state.rows[state.rows["video_id"].isin(meta.index)].merge(meta, left_on="video_id", right_index=True)
    live = live.sort_values(["path", "shot_index"]).reset_index(drop=True)
    for col in ("start_frame", "end_frame", "shot_index", "scene_index"):
        live[col] = live[col].astype("int64")
    live["num_frames"] = live["end_frame"] - live["start_frame"]
    live["start_s"] = live["start_frame"] / live["fps"]
    live["end_s"] = live["end_frame"] / live["fps"]
    live["duration_s"] = live["num_frames"] / live["fps"]
    usable = live[live["reason"].isna()]
    # one dtype per column whether rows came from this run or from the parquet state
    shots = usable[SHOT_COLUMNS].reset_index(drop=True).astype(
        {"video_id": "str", "path": "str", "clip_shard": "str", "clip_member": "str"})
    short = live[live["reason"].notna()]
    failed = pd.DataFrame([{"video_id": v, "reason": r} for v, r in failed.items() if v in meta.index],
                          columns=["video_id", "reason"]).merge(meta[["path"]], left_on="video_id", right_index=True)
    rejected = pd.concat([short[REJECT_COLUMNS], failed.reindex(columns=REJECT_COLUMNS)], ignore_index=True)
    rejected = rejected.astype({"shot_index": "Int64", "scene_index": "Int64", "start_frame": "Int64",
                                "end_frame": "Int64", "video_id": "str", "path": "str", "reason": "str"})
    rejected = rejected.sort_values(["path", "shot_index"], na_position="first").reset_index(drop=True)
    counts = {
        "videos": len(ok), "videos_split": len(todo), "videos_reused": len(ok) - len(todo),
        "videos_failed": int(len(failed)), "shots": len(shots), "shots_rejected_short": len(short),
        "single_shot_videos": int((usable.groupby("video_id").size() == 1).sum()) if len(usable) else 0,
        "usable_s": float(shots["duration_s"].sum()), "video_s_split": round(seconds, 3),
        "video_s_per_s": round(seconds / max(progress.elapsed_s, 1e-9), 3),
        # clips of videos no longer in the manifest stay in their shards (no compaction yet)
        "clips_orphaned": int((~state.rows["video_id"].isin(meta.index) & state.rows["clip_member"].notna()).sum()),
    }
    return ShotsOutcome(shots, rejected, counts)
