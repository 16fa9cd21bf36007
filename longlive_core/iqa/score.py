"""Quality and motion scores per shot, and the keep decision.

Raw scores are cached per shot under ``state_dir`` keyed by ``IQAConfig.cache_key``: changing a
threshold re-decides ``kept`` without re-scoring anything, which is how curators tune.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from longlive_core.io.atomic import write_parquet
from longlive_core.iqa.metrics import IQAConfig, QualityMetric
from longlive_core.iqa.motion import motion_score
from longlive_core.progress import Progress
from longlive_core.shots.clips import iter_clip_frames, read_clip
from longlive_core.tracking.lineage import digest_json

log = logging.getLogger(__name__)

SCORE_COLUMNS = ["iqa_metric", "iqa_score", "motion_score", "kept", "reject_reason"]
_KEY = ["video_id", "shot_index", "start_frame", "end_frame"]


def sample_positions(num_frames: int, k: int) -> list[int]:
    """k frame indices spread over the shot, each with a successor for the motion pair."""
    if num_frames < 2:
        return [0]
    return sorted({int(round(x)) for x in np.linspace(0, num_frames - 2, k)})


def _aggregate(values: np.ndarray, how: str, lower_better: bool) -> float:
    if how == "mean":
        return float(values.mean())
    if how == "median":
        return float(np.median(values))
    return float(values.max() if lower_better else values.min())


@dataclasses.dataclass
class IQAOutcome:
    scores: pd.DataFrame
    counts: dict[str, float]


def score_shots(shots: pd.DataFrame, clips_dir: Path, cfg: IQAConfig, metric: QualityMetric,
                state_dir: Path, checkpoint_every: int = 200) -> IQAOutcome:
    key = digest_json(cfg.cache_key())
    cache_path = state_dir / "scores.parquet"
    cache = pd.read_parquet(cache_path) if cache_path.is_file() else pd.DataFrame(
        columns=[*_KEY, "key", "iqa_score", "motion_score"])
    cache = cache[cache["key"] == key]
    known = {tuple(r[:4]): (r[4], r[5]) for r in cache[[*_KEY, "iqa_score", "motion_score"]].itertuples(index=False)}
    todo = [r for r in shots.itertuples(index=False)
            if (r.video_id, r.shot_index, r.start_frame, r.end_frame) not in known]
    progress = Progress(log, "iqa_filter", len(todo), "shots")
    new_rows: list[dict] = []

    def flush() -> None:
        nonlocal cache
        if new_rows:
            cache = pd.concat([cache, pd.DataFrame(new_rows)], ignore_index=True)
            new_rows.clear()
        write_parquet(cache, cache_path)

    # shots are scored a batch of frames at a time; a batch holds frames of one size only
    batch: list[tuple[object, list[np.ndarray], float]] = []

    def score_batch() -> None:
        if not batch:
            return
        frames = np.stack([f for _, fs, _ in batch for f in fs])
        values = metric(frames)
        pos = 0
        for shot, fs, motion in batch:
            s = _aggregate(values[pos:pos + len(fs)], cfg.aggregate, metric.lower_better)
            pos += len(fs)
            new_rows.append({"video_id": shot.video_id, "shot_index": shot.shot_index,
                             "start_frame": shot.start_frame, "end_frame": shot.end_frame, "key": key,
                             "iqa_score": s, "motion_score": motion})
            known[(shot.video_id, shot.shot_index, shot.start_frame, shot.end_frame)] = (s, motion)
            progress.advance()
        batch.clear()
        if len(new_rows) >= checkpoint_every:
            flush()

    try:
        for shot in todo:
            positions = sample_positions(shot.num_frames, cfg.frames_per_shot)
            wanted = set(positions) | {p + 1 for p in positions}
            decoded = {i: f for i, f in enumerate(iter_clip_frames(read_clip(clips_dir, shot.clip_shard,
                                                                             shot.clip_member)))
                       if i in wanted}
            frames = [decoded[p] for p in positions]
            pairs = [(decoded[p], decoded[p + 1]) for p in positions if p + 1 in decoded]
            motion = motion_score(pairs, cfg.motion_width)
            if batch and (batch[0][1][0].shape != frames[0].shape
                          or sum(len(fs) for _, fs, _ in batch) + len(frames) > cfg.batch_size):
                score_batch()
            batch.append((shot, frames, motion))
        score_batch()
    finally:
        flush()

    threshold = cfg.thresholds[cfg.metric]
    out = shots.copy()
    out["iqa_metric"] = cfg.metric
    vals = [known[(r.video_id, r.shot_index, r.start_frame, r.end_frame)] for r in shots.itertuples(index=False)]
    out["iqa_score"] = [v[0] for v in vals]
    out["motion_score"] = [v[1] for v in vals]
    direction = "<=" if metric.lower_better else ">="
    reasons = []
    for s, m in zip(out["iqa_score"], out["motion_score"]):
        if not metric.keeps(s, threshold):
            reasons.append(f"quality: {cfg.metric} {s:.3f} not {direction} {threshold}")
        elif m < cfg.min_motion:
            reasons.append(f"static: motion {m:.3f} < {cfg.min_motion}")
        else:
            reasons.append("")
    out["reject_reason"] = reasons
    out["kept"] = out["reject_reason"] == ""
    counts = {"shots": len(out), "scored": len(todo), "reused": len(out) - len(todo),
              "kept": int(out["kept"].sum()),
              "rejected_quality": int(out["reject_reason"].str.startswith("quality").sum()),
              "rejected_static": int(out["reject_reason"].str.startswith("static").sum()),
              "shots_per_s": round(len(todo) / max(progress.elapsed_s, 1e-9), 3),
              "iqa_score_mean": float(out["iqa_score"].mean()) if len(out) else 0.0,
              "motion_score_mean": float(out["motion_score"].mean()) if len(out) else 0.0}
    return IQAOutcome(out, counts)
