"""Splitting ingested videos into shots: detection, length rules, clip shards, incremental state.

``split_video`` is the per-video work (pure: a path in, shot rows and clip bytes out) and runs in
whatever executor the stage is given. ``split_videos`` drives it over a manifest and keeps the
state that makes reruns incremental: a video is done once its clips sit in a closed shard and its
rows in ``state/``. What a video's rows depend on besides its bytes (the shots params that shape
them and the code that makes them, ``split_key``) keys the whole state: a change redoes every
video. A video that fails is reported in the rejected table and tried again on the next run.
Shards that no row of a current video refers to (old settings, videos gone from the manifest)
are deleted at the end of a run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import re
from pathlib import Path

import pandas as pd

from longlive_core.data.roots import resolve_inside
from longlive_core.io.atomic import remove_unreferenced, write_json
from longlive_core.io.parts import PartTable
from longlive_core.parallel import Executor
from longlive_core.progress import Progress
from longlive_core.shots.clips import ShardWriter, cut_clips
from longlive_core.shots.compaction import compact_shards
from longlive_core.shots.detect import ShotsConfig, detect_cuts
from longlive_core.shots.rules import apply_length_rules, shots_from_cuts
from longlive_core.tracking.lineage import code_digest, digest_json

log = logging.getLogger(__name__)

# scene_index: the detected shot a row comes from; rows of one scene are pieces of a long shot.
# Times (start_s, end_s) come from the frames' timestamps, relative to the video's first frame.
SHOT_COLUMNS = ["video_id", "shot_index", "scene_index", "start_frame", "end_frame", "start_s", "end_s",
                "duration_s", "num_frames", "fps", "path", "clip_shard", "clip_member", "clip_sha256"]
REJECT_COLUMNS = ["video_id", "path", "shot_index", "scene_index", "start_frame", "end_frame", "start_s",
                  "end_s", "duration_s", "reason"]
STATE_COLUMNS = ["video_id", "fps", "shot_index", "scene_index", "start_frame", "end_frame", "start_s", "end_s",
                 "reason", "clip_shard", "clip_member", "clip_sha256"]
SHARD_NAME = re.compile(r"shard-\d+\.tar")


@dataclasses.dataclass(frozen=True)
class VideoJob:
    video_id: str
    path: str  # absolute, already checked to lie inside the source root
    relpath: str
    fps: float  # the average rate ingest measured: the detector's frame-count settings and the clips' rate
    num_frames: int
    cfg: ShotsConfig


@dataclasses.dataclass
class VideoShots:
    job: VideoJob
    cuts: list[int]
    rows: list[dict]  # STATE_COLUMNS but the shard, which the writer assigns
    clips: dict[int, bytes]  # shot_index -> clip bytes, for the usable shots


def split_key(cfg: ShotsConfig) -> str:
    """What every video's rows and clips depend on besides its bytes: the params that shape them
    and the code that makes them (the same files dvc.yaml lists for the stage)."""
    return digest_json([cfg.result_params(), code_digest("longlive_core.shots.split")])


def split_video(job: VideoJob) -> VideoShots:
    detection = detect_cuts(job.path, job.cfg, job.fps)
    times = detection.times
    n = len(times)
    if n == 0:
        raise ValueError("no frame decodes")
    # the last frame lasts as long as the typical frame before it
    last = sorted(b - a for a, b in zip(times, times[1:]))[(n - 1) // 2] if n > 1 else 1.0 / job.fps
    ends = [*times[1:], times[-1] + last]
    bounds = list(itertools.accumulate([*times, ends[-1]], max))  # a repeated or late timestamp adds no time
    pieces = apply_length_rules(shots_from_cuts(n, detection.cuts), bounds, job.cfg.min_shot_s, job.cfg.max_shot_s)
    usable = {i: (p.start_frame, p.end_frame) for i, p in enumerate(pieces) if p.reason is None}
    decoded, clips = cut_clips(job.path, usable, job.fps, job.cfg.clip_crf, job.cfg.clip_preset)
    if decoded != n:
        raise ValueError(f"the clip pass decoded {decoded} frames, the detection pass {n}")
    rows = []
    for i, piece in enumerate(pieces):
        clip = clips.get(i)
        rows.append({"video_id": job.video_id, "fps": job.fps, "shot_index": i, "scene_index": piece.scene_index,
                     "start_frame": piece.start_frame, "end_frame": piece.end_frame,
                     "start_s": times[piece.start_frame], "end_s": ends[piece.end_frame - 1], "reason": piece.reason,
                     "clip_member": f"{job.video_id}/{i:04d}.mp4" if clip is not None else None,
                     "clip_sha256": hashlib.sha256(clip).hexdigest() if clip is not None else None})
    return VideoShots(job, detection.cuts, rows, clips)


class ShotsState:
    """Rows of every finished video, kept across runs under ``state_dir`` (a part file per closed
    shard, folded into one at the end of a run) with the key they were made under. A video split
    again (its frame rate changed) has its rows in a later part, which supersedes the earlier."""

    def __init__(self, state_dir: str | Path, key: str):
        self.table = PartTable(state_dir, "pieces", STATE_COLUMNS)
        self.superseded: set[str] = set()  # shards that held rows replaced in this run
        # rows appended since ``rows`` was last read: merged only when read, so a run's thousands of
        # appends each cost their own rows, not the whole table's (millions of rows at 120K videos)
        self._parts: list[pd.DataFrame] = []
        meta = Path(state_dir) / "key.json"
        if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
            self._rows = self.table.read(latest_by="video_id")
        else:
            if self.table.files():
                log.info("shots params or code changed since the last run: every video is split again")
            self.table.clear()
            self._rows = pd.DataFrame(columns=STATE_COLUMNS)
            write_json({"key": key}, meta)

    @property
    def rows(self) -> pd.DataFrame:
        """Every video's latest rows; the shards of the rows they replaced join ``superseded``."""
        if self._parts:
            parts = [self._rows, *self._parts]
            table = pd.concat([p.assign(_order=i) for i, p in enumerate(parts)], ignore_index=True)
            latest = table["_order"] == table.groupby("video_id")["_order"].transform("max")
            self.superseded.update(table.loc[~latest, "clip_shard"].dropna())
            self._rows = table[latest].drop(columns="_order").reset_index(drop=True)
            self._parts = []
        return self._rows

    def done(self, fps: dict[str, float]) -> set[str]:
        """The videos split already at the frame rate ``fps`` gives them (the rate the length rules
        and the detector's time settings were measured in)."""
        made = self.rows.drop_duplicates("video_id").set_index("video_id")["fps"]
        return {v for v, rate in made.items() if fps.get(v) == rate}

    def append(self, rows: list[dict]) -> None:
        """Records finished videos (their shard is closed); they replace earlier rows of theirs."""
        if rows:
            part = pd.DataFrame(rows, columns=STATE_COLUMNS)
            self.table.append(part)
            self._parts.append(part)

    def compact(self, keep_videos: set[str]) -> None:
        """Keeps only the rows of ``keep_videos``, in one file."""
        self._rows = self.rows[self.rows["video_id"].isin(keep_videos)].reset_index(drop=True)
        self.table.compact(self._rows)


@dataclasses.dataclass
class ShotsOutcome:
    shots: pd.DataFrame
    rejected: pd.DataFrame
    counts: dict[str, float]


def _write(executor: Executor, todo: list[VideoJob], writer: ShardWriter, state: ShotsState,
           progress: Progress, failed: dict[str, str]) -> None:
    """Runs the jobs and stores their clips; a video becomes state only once its shard is closed."""
    pending: list[dict] = []  # rows whose clips sit in the open shard
    try:
        for job, result in executor.map_unordered(split_video, todo):
            progress.advance()
            if isinstance(result, BaseException):
                reason = f"failed: {type(result).__name__}: {result}"
                log.warning("%s: %s", job.relpath, reason)
                failed[job.video_id] = reason
                continue
            for row in result.rows:
                if row["clip_member"] is not None:
                    row["clip_shard"] = writer.add(row["clip_member"], result.clips[row["shot_index"]])
                pending.append(row)
            if writer.full:
                writer.close()
                state.append(pending)
                pending = []
        writer.close()
        state.append(pending)
    except BaseException:
        writer.abort()  # a Ctrl-C or a full disk: nothing half-written is published or recorded
        raise


def split_videos(manifest: pd.DataFrame, root: Path, cfg: ShotsConfig, state_dir: Path, clips_dir: Path,
                 executor: Executor) -> ShotsOutcome:
    ok = manifest[manifest["status"] == "ok"]
    state = ShotsState(state_dir, split_key(cfg))
    done = state.done(dict(zip(ok["video_id"], ok["fps"].astype(float))))
    todo = [VideoJob(r.video_id, str(resolve_inside(root, r.path)), r.path, float(r.fps), int(r.num_frames), cfg)
            for r in ok.itertuples(index=False) if r.video_id not in done]
    writer = ShardWriter(clips_dir, int(cfg.shard_max_mb * 1024 * 1024))
    failed: dict[str, str] = {}
    progress = Progress(log, "shots", len(todo), "videos")
    seconds = sum(j.num_frames / j.fps for j in todo)
    _write(executor, todo, writer, state, progress, failed)

    live_ids = set(ok["video_id"])
    gone = state.rows[~state.rows["video_id"].isin(live_ids)]
    # the shards that lost clips in this run: gone videos' and those of videos split again
    touched = set(gone["clip_shard"].dropna()) | state.superseded
    live = state.rows[state.rows["video_id"].isin(live_ids)]
    moved, compacted, orphaned = compact_shards(live, touched, clips_dir, cfg.shard_min_live,
                                                int(cfg.shard_max_mb * 1024 * 1024))
    state.append(moved)
    state.compact(live_ids)
    shards_removed = remove_unreferenced(clips_dir, SHARD_NAME, set(state.rows["clip_shard"].dropna()))

    meta = ok.set_index("video_id")[["path"]]  # the rows carry the fps they were split at
    live = state.rows.merge(meta, left_on="video_id", right_index=True)
    live = live.sort_values(["path", "shot_index"]).reset_index(drop=True)
    for col in ("start_frame", "end_frame", "shot_index", "scene_index"):
        live[col] = live[col].astype("int64")
    live["num_frames"] = live["end_frame"] - live["start_frame"]
    live["duration_s"] = live["end_s"] - live["start_s"]
    usable = live[live["reason"].isna()]
    # one dtype per column whether rows came from this run or from the parquet state
    shots = usable[SHOT_COLUMNS].reset_index(drop=True).astype(
        {"video_id": "str", "path": "str", "clip_shard": "str", "clip_member": "str", "clip_sha256": "str",
         "start_s": "float64", "end_s": "float64", "duration_s": "float64", "fps": "float64"})
    short = live[live["reason"].notna()]
    failed = pd.DataFrame([{"video_id": v, "reason": r} for v, r in failed.items() if v in meta.index],
                          columns=["video_id", "reason"]).merge(meta, left_on="video_id", right_index=True)
    rejected = pd.concat([short[REJECT_COLUMNS], failed.reindex(columns=REJECT_COLUMNS)], ignore_index=True)
    rejected = rejected.astype({"shot_index": "Int64", "scene_index": "Int64", "start_frame": "Int64",
                                "end_frame": "Int64", "video_id": "str", "path": "str", "reason": "str",
                                "start_s": "float64", "end_s": "float64", "duration_s": "float64"})
    rejected = rejected.sort_values(["path", "shot_index"], na_position="first").reset_index(drop=True)
    counts = {
        "videos": len(ok), "videos_split": len(todo), "videos_reused": len(ok) - len(todo),
        "videos_failed": int(len(failed)), "shots": len(shots), "shots_rejected_short": len(short),
        "single_shot_videos": int((usable.groupby("video_id").size() == 1).sum()) if len(usable) else 0,
        "usable_s": float(shots["duration_s"].sum()), "video_s_split": round(seconds, 3),
        "video_s_per_s": round(seconds / max(progress.elapsed_s, 1e-9), 3),
        # clips no row refers to, left in shards still in use (too few to rewrite the shard for)
        "clips_orphaned": orphaned, "shards_compacted": compacted, "shards_removed": shards_removed,
    }
    return ShotsOutcome(shots, rejected, counts)
