"""Quality and motion scores per shot, and the keep decision.

Raw scores are cached per clip under ``state_dir``, by the clip's content digest and a key of what
else they depend on (``score_key``: the scoring params, the metric's weights, the scoring code):
re-encoded clips or new weights are scored afresh, while changing a threshold re-decides ``kept``
without scoring anything, which is how curators tune.

A sampled frame the metric cannot score (``QualityMetric``: uniform, such as black) is counted in
``iqa_unscorable`` and left out of the shot's score; a shot with no scorable frame has no score
(null) and is rejected as unscorable. The same decode pass hashes each shot's frames (``dedup``), so
near-duplicates are regrouped from the cache when their threshold changes, as kept is re-decided.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd

from longlive_core.devices import pick_device
from longlive_core.io.parts import PartTable
from longlive_core.iqa.dedup import format_hashes, hash_frames, mark_near_duplicates, phash
from longlive_core.iqa.metrics import IQAConfig, QualityMetric, keeps, lower_is_better
from longlive_core.iqa.motion import motion_score
from longlive_core.models.weights import weights_identity
from longlive_core.parallel import Executor, worker_slot
from longlive_core.progress import Progress
from longlive_core.shots.clips import clip_frames_at, read_clip
from longlive_core.tracking.lineage import code_digest, digest_json

log = logging.getLogger(__name__)

SCORE_COLUMNS = ["iqa_metric", "iqa_score", "iqa_frames", "iqa_unscorable", "motion_score", "phash", "dup_group",
                 "kept", "reject_reason"]
VALUE_COLUMNS = ["iqa_score", "iqa_frames", "iqa_unscorable", "motion_score", "phash"]
CACHE_COLUMNS = ["clip_sha256", "key", *VALUE_COLUMNS]


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
    """Over the frames the metric could score (NaN where it scored none: the caller says why)."""
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan
    if how == "mean":
        return float(values.mean())
    if how == "median":
        return float(np.median(values))
    return float(values.max() if lower_better else values.min())


@dataclasses.dataclass
class IQAOutcome:
    scores: pd.DataFrame
    counts: dict[str, float]


@dataclasses.dataclass(frozen=True)
class ShotRef:
    clip_sha256: str
    clip_shard: str
    clip_member: str
    num_frames: int


@dataclasses.dataclass(frozen=True)
class ScoreTask:
    """One executor item: a few shots, about one batch of frames (a task per shot would pay the
    executor's per-task cost for a fraction of a batch)."""
    clips_dir: str
    cfg: IQAConfig
    shots: tuple[ShotRef, ...]


@dataclasses.dataclass(frozen=True)
class ShotScore:
    """What a clip is scored to: one row of the cache (VALUE_COLUMNS)."""
    clip_sha256: str
    iqa_score: float  # NaN: no sampled frame could be scored
    iqa_frames: int  # frames sampled
    iqa_unscorable: int  # of those, frames the metric could not score
    motion_score: float
    phash: str  # dedup.format_hashes of the frames at dedup.HASH_POSITIONS

    def values(self) -> dict:
        return {k: getattr(self, k) for k in VALUE_COLUMNS}


_WORKER_METRIC: tuple[IQAConfig, QualityMetric] | None = None


def worker_metric(cfg: IQAConfig) -> QualityMetric:
    """The metric, built once per worker process on the worker's own device."""
    global _WORKER_METRIC
    if _WORKER_METRIC is None or _WORKER_METRIC[0] != cfg:
        _WORKER_METRIC = None  # the old network goes before the new one is built
        _WORKER_METRIC = (cfg, QualityMetric(cfg, pick_device(cfg.device, "iqa_filter.device", worker_slot())))
    return _WORKER_METRIC[1]


def score_task(task: ScoreTask) -> list[ShotScore]:
    """The scores of each of the task's shots."""
    cfg, metric = task.cfg, worker_metric(task.cfg)
    out: list[ShotScore] = []
    batch: list[tuple[ShotRef, list[np.ndarray], float, str]] = []  # a batch holds frames of one size only

    def score_batch() -> None:
        if not batch:
            return
        values = metric(np.stack([f for _, fs, _, _ in batch for f in fs]))
        pos = 0
        for shot, fs, motion, hashes in batch:
            v = values[pos:pos + len(fs)]
            out.append(ShotScore(shot.clip_sha256, _aggregate(v, cfg.aggregate, metric.lower_better), len(fs),
                                 int((~np.isfinite(v)).sum()), motion, hashes))
            pos += len(fs)
        batch.clear()

    for shot in task.shots:
        positions = sample_positions(shot.num_frames, cfg.frames_per_shot)
        hashed = hash_frames(shot.num_frames)
        decoded = clip_frames_at(read_clip(Path(task.clips_dir), shot.clip_shard, shot.clip_member),
                                 set(positions) | {p + 1 for p in positions} | set(hashed))
        frames = [decoded[p] for p in positions]
        pairs = [(decoded[p], decoded[p + 1]) for p in positions if p + 1 in decoded]
        motion = motion_score(pairs, cfg.motion_width)
        hashes = format_hashes([phash(decoded[i]) for i in hashed])
        if batch and (batch[0][1][0].shape != frames[0].shape
                      or sum(len(fs) for _, fs, _, _ in batch) + len(frames) > cfg.batch_size):
            score_batch()
        batch.append((shot, frames, motion, hashes))
    score_batch()
    return out


def score_tasks(todo: list, clips_dir: Path, cfg: IQAConfig) -> list[ScoreTask]:
    per_task = max(1, cfg.batch_size // cfg.frames_per_shot)
    refs = [ShotRef(r.clip_sha256, r.clip_shard, r.clip_member, int(r.num_frames)) for r in todo]
    return [ScoreTask(str(clips_dir), cfg, tuple(refs[i:i + per_task])) for i in range(0, len(refs), per_task)]


def score_shots(shots: pd.DataFrame, clips_dir: Path, cfg: IQAConfig, state_dir: Path, executor: Executor,
                checkpoint_every: int = 200) -> IQAOutcome:
    """Scores the shots the cache lacks through ``executor`` (a failed task fails the stage, naming
    its clips: a shot that cannot be scored is a broken clip, which `shots` should have caught),
    checkpointing the cache every ``checkpoint_every`` shots, then decides ``kept``."""
    key = score_key(cfg)
    lower_better = lower_is_better(cfg.metric)
    table = PartTable(state_dir, "scores", CACHE_COLUMNS)
    cache = table.read()
    cache = cache[cache["key"] == key]
    known: dict[str, dict] = dict(zip(cache["clip_sha256"], cache[VALUE_COLUMNS].to_dict("records")))
    todo = [r for r in shots.drop_duplicates("clip_sha256").itertuples(index=False) if r.clip_sha256 not in known]
    progress = Progress(log, "iqa_filter", len(todo), "shots")
    new_rows: list[dict] = []

    def flush() -> None:
        table.append(pd.DataFrame(new_rows, columns=CACHE_COLUMNS))
        new_rows.clear()

    try:
        for task, result in executor.map_unordered(score_task, score_tasks(todo, clips_dir, cfg)):
            if isinstance(result, BaseException):
                members = ", ".join(f"{s.clip_shard}:{s.clip_member}" for s in task.shots)
                raise RuntimeError(f"scoring failed for the clips {members}: {type(result).__name__}: {result} "
                                   "(the shots scored so far are kept; rerun to continue)") from result
            for shot in result:
                new_rows.append({"clip_sha256": shot.clip_sha256, "key": key, **shot.values()})
                known[shot.clip_sha256] = shot.values()
                progress.advance()
            if len(new_rows) >= checkpoint_every:
                flush()
    finally:
        flush()
    # keep what today's shots use, so the cache does not grow with every re-split
    live = set(shots["clip_sha256"])
    table.compact(pd.DataFrame([{"clip_sha256": c, "key": key, **v} for c, v in known.items() if c in live],
                               columns=CACHE_COLUMNS))

    threshold = cfg.thresholds[cfg.metric]
    out = shots.copy()
    out["iqa_metric"] = cfg.metric
    for column in VALUE_COLUMNS:
        out[column] = [known[c][column] for c in shots["clip_sha256"]]
    out = out.astype({"iqa_score": "float64", "iqa_frames": "int64", "iqa_unscorable": "int64",
                      "motion_score": "float64"})
    direction = "<=" if lower_better else ">="
    reasons = []
    for s, n, m in zip(out["iqa_score"], out["iqa_frames"], out["motion_score"]):
        if math.isnan(s):
            reasons.append(f"unscorable: {cfg.metric} could score none of the shot's {n} sampled frames (a uniform "
                           "frame, such as a black one, has no quality to measure)")
        elif not keeps(s, threshold, lower_better):
            reasons.append(f"quality: {cfg.metric} {s:.3f} not {direction} {threshold}")
        elif m < cfg.min_motion:
            reasons.append(f"static: motion {m:.3f} < {cfg.min_motion}")
        else:
            reasons.append("")
    out["reject_reason"] = reasons
    out["kept"] = out["reject_reason"] == ""
    out, groups = mark_near_duplicates(out, cfg.dedup_hamming, lower_better)
    out = out[[*shots.columns, *SCORE_COLUMNS]]
    scored = out["iqa_score"].dropna()
    counts = {"shots": len(out), "scored": len(todo), "reused": len(out) - len(todo),
              "kept": int(out["kept"].sum()),
              "rejected_quality": int(out["reject_reason"].str.startswith("quality").sum()),
              "rejected_unscorable": int(out["reject_reason"].str.startswith("unscorable").sum()),
              "rejected_static": int(out["reject_reason"].str.startswith("static").sum()),
              "rejected_duplicate": int(out["reject_reason"].str.startswith("near-duplicate").sum()),
              "duplicate_groups": groups,
              "unscorable_frames": int(out["iqa_unscorable"].sum()),
              "shots_per_s": round(len(todo) / max(progress.elapsed_s, 1e-9), 3),
              "iqa_score_mean": float(scored.mean()) if len(scored) else 0.0,
              "motion_score_mean": float(out["motion_score"].mean()) if len(out) else 0.0}
    return IQAOutcome(out, counts)
