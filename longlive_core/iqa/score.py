"""Quality and motion scores per shot, and the keep decision.

Raw scores are cached per clip under ``state_dir``, by the clip's content digest and a key of what
else they depend on (``score_key``: the scoring params, the metric's weights, the scoring code):
re-encoded clips or new weights are scored afresh, while changing a threshold re-decides ``kept``
without scoring anything, which is how curators tune.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from longlive_core.io.parts import PartTable
from longlive_core.iqa.metrics import IQAConfig, QualityMetric
from longlive_core.iqa.motion import motion_score
from longlive_core.models.weights import weights_identity
from longlive_core.progress import Progress
from longlive_core.shots.clips import clip_frames_at, read_clip
from longlive_core.tracking.lineage import code_digest, digest_json

log = logging.getLogger(__name__)

SCORE_COLUMNS = ["iqa_metric", "iqa_score", "motion_score", "kept", "reject_reason"]
CACHE_COLUMNS = ["clip_sha256", "key", "iqa_score", "motion_score"]


def score_key(cfg: IQAConfig) -> str:
    """What a clip's raw scores depend on besides its bytes (thresholds do not)."""
    weights = weights_identity(cfg.maniqa_checkpoint) if cfg.metric == "maniqa" else None
    return digest_json([cfg.score_params(), weights, code_digest("longlive_core.iqa.score")])


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
    key = score_key(cfg)
    table = PartTable(state_dir, "scores", CACHE_COLUMNS)
    cache = table.read()
    cache = cache[cache["key"] == key]
    known = dict(zip(cache["clip_sha256"], zip(cache["iqa_score"], cache["motion_score"])))
    todo = [r for r in shots.drop_duplicates("clip_sha256").itertuples(index=False) if r.clip_sha256 not in known]
    progress = Progress(log, "iqa_filter", len(todo), "shots")
    new_rows: list[dict] = []

    def flush() -> None:
        table.append(pd.DataFrame(new_rows, columns=CACHE_COLUMNS))
        new_rows.clear()

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
            new_rows.append({"clip_sha256": shot.clip_sha256, "key": key, "iqa_score": s, "motion_score": motion})
            known[shot.clip_sha256] = (s, motion)
            progress.advance()
        batch.clear()
        if len(new_rows) >= checkpoint_every:
            flush()

    try:
        for shot in todo:
            positions = sample_positions(shot.num_frames, cfg.frames_per_shot)
            decoded = clip_frames_at(read_clip(clips_dir, shot.clip_shard, shot.clip_member),
                                     set(positions) | {p + 1 for p in positions})
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
    # keep what today's shots use, so the cache does not grow with every re-split
    live = set(shots["clip_sha256"])
    table.compact(pd.DataFrame([{"clip_sha256": c, "key": key, "iqa_score": v[0], "motion_score": v[1]}
                                for c, v in known.items() if c in live], columns=CACHE_COLUMNS))

    threshold = cfg.thresholds[cfg.metric]
    out = shots.copy()
    out["iqa_metric"] = cfg.metric
    vals = [known[c] for c in shots["clip_sha256"]]
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
